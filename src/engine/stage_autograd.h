// The autograd pieces of a stage's compute: fresh leaves for a stage's
// inputs, backward from output gradients, checks on what loss_fn returned,
// and per-layer timing within one backward pass.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <utility>
#include <vector>

#include "engine/call.h"
#include "runtime/device.h"

namespace roundpipe {

// `value` (a slot's value moved to the device) with every tensor a fresh
// leaf, and the leaves; floating-point tensors require grad (at layer 0
// only those of the slot's `original` value, the caller's tensors, that
// required grad), and the value holds them through an identity that the
// first layer may change in place.
std::pair<c10::IValue, std::vector<at::Tensor>> make_leaves(const c10::IValue& value,
                                                            const c10::IValue& original,
                                                            int64_t start_layer);

// The gradients of `leaves` (undefined where a leaf has none), as a list.
c10::IValue leaf_grads(const std::vector<at::Tensor>& leaves);

// Backpropagates `grads` (aligned with flatten_tensors(outputs)).
void backward_outputs(const c10::IValue& outputs, const std::vector<at::Tensor>& grads);

// What loss_fn returned must be something backward can start from: scalar
// tensors that depend on the outputs (checked here, so the message says
// what to change rather than what autograd could not do).
void check_losses(const c10::IValue& loss, const std::vector<at::Tensor>& roots);

// Times each layer's backward within one autograd pass over a stage: a hook
// on each layer's output marks when its gradient is complete, which is when
// the backward of the layer after it has finished.
class BackwardTimer {
 public:
  // `on` false: records nothing.
  BackwardTimer(Device& dev, LayerRange layers, int64_t microbatch, bool on = true);

  // `output` is what layer l (not the stage's last) returned.
  void watch(int64_t l, const c10::IValue& output);
  void start();
  // After the backward pass: one record per layer, or per run of layers
  // whose inner boundaries were not marked.
  void finish(std::vector<LayerTimeRecord>& out);

 private:
  Device& dev_;
  LayerRange layers_;
  int64_t microbatch_;
  bool on_;
  std::shared_ptr<std::vector<MarkPtr>> boundaries_;  // [k]: before layer begin + k; shared with hooks
};

}  // namespace roundpipe
