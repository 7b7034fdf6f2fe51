// The engine's handle on one layer: its host tensors, and per-device replicas
// that run it with device tensors.
//
// Thread-safety: bind/forward/unbind of replica r are called only by device
// r's worker thread; host-side queries are called by the user thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <roundpipe/microbatch.h>

namespace torch {
namespace nn {
class AnyModule;
}
}  // namespace torch

namespace roundpipe {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

class LayerHandle {
 public:
  virtual ~LayerHandle() = default;

  // For error messages: "torch::nn::LinearImpl".
  virtual std::string type_name() const = 0;
  // The master parameters / buffers, in a fixed order (recursive, in
  // registration order). Tied tensors may appear in several layers.
  virtual NamedTensors named_parameters() const = 0;
  virtual NamedTensors named_buffers() const = 0;
  virtual bool is_training() const = 0;
  virtual void train(bool on) = 0;
  // False only for a layer that never draws random numbers (roundpipe/layer.h,
  // RandomFree): its runs skip the keyed generator.
  virtual bool may_draw_random() const { return true; }

  // Makes replica `replica` use the given device tensors (same order as
  // named_parameters / named_buffers). Returns the tensors that receive this
  // replica's parameter gradients in their .grad.
  virtual std::vector<at::Tensor> bind(int replica, const std::vector<at::Tensor>& params,
                                       const std::vector<at::Tensor>& buffers) = 0;
  // The replica's buffer tensors (updated in place or replaced by forward).
  virtual std::vector<at::Tensor> bound_buffers(int replica) = 0;
  virtual c10::IValue forward(int replica, std::vector<c10::IValue> args, Kwargs kwargs) = 0;
  // Drops every device tensor (and gradient) the replica holds.
  virtual void unbind(int replica) = 0;
  // Makes the replicas of devices 0..count-1 now, on the user thread, for
  // layers whose replicas cannot be made later without side effects.
  virtual void make_replicas(int count) {}
};

// Points a replica's parameter and buffer variables at empty tensors and drops
// the parameters' gradients: what LayerHandle::unbind does with a replica's variables.
void release_replica_tensors(std::vector<at::Tensor>& params, std::vector<at::Tensor>& buffers);

// A layer backed by a libtorch module (see roundpipe/layer.h for how it is
// called). Throws c10::ValueError if the module cannot be cloned or has
// tensors off the CPU.
std::shared_ptr<LayerHandle> make_module_layer(torch::nn::AnyModule module, int64_t index);

}  // namespace roundpipe
