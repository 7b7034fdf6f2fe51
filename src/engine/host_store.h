// The host-resident model state: master parameters (packed into one
// contiguous arena per layer, or left in place: PinMode), fp32 gradient
// accumulators, and buffers.
//
// Thread-compatible: owned by the user thread of the model; device workers
// only read arenas and buffers while a call runs (the user thread does not
// write them then).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/layer.h"
#include "roundpipe/model.h"

namespace roundpipe {

// One unique parameter of the model (tied parameters appear once).
struct HostParam {
  std::string name;   // "<layer>.<name in layer>" where first found, e.g. "3.weight"
  at::Tensor master;  // the model's own parameter; its data views the owner's arena (if it has one)
  int64_t owner = 0;  // the first layer using it
  int64_t offset = 0; // byte offset in the owner's arena
  at::Tensor grad;    // fp32 accumulator [same shape], undefined until a gradient arrives
  at::Tensor optim;   // optimizer copy [same shape] in optim dtype (trainable parameters only)
  bool trainable() const { return master.requires_grad(); }
};

struct HostLayer {
  std::vector<int64_t> param_ids;  // per layer parameter (named_parameters order) -> HostParam
  at::Tensor arena;                // uint8 [arena bytes]: the parameters this layer owns (kAlloc only)
  std::vector<int64_t> owned;      // HostParam ids first used by this layer (stored in `arena`)
  int64_t param_bytes = 0;         // bytes of all this layer's parameters (tied ones included)
};

class HostStore {
 public:
  // Keeps the layers' parameters as `mode` says; `page_lock` (the devices
  // are CUDA devices) page-locks them (kAlloc, kRegister).
  HostStore(const std::vector<std::shared_ptr<Layer>>& layers, PinMode mode, bool page_lock);
  ~HostStore();
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  std::vector<HostParam>& params() { return params_; }
  const std::vector<HostParam>& params() const { return params_; }
  const HostLayer& layer(int64_t i) const { return layers_.at(i); }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  std::vector<int64_t> layer_param_bytes() const;

  // The tensor of parameter `id` inside its owner's host arena: a storage of
  // its own (from_blob, keeping the arena alive), so that the model's
  // parameters do not share memory in the eyes of savers such as safetensors.
  at::Tensor view_in(const at::Tensor& arena, int64_t id) const;
  // The same inside a device copy of the arena: a view narrowed from it, so
  // the device allocator sees the arena's storage in use for as long as any
  // parameter is.
  at::Tensor view_on_device(const at::Tensor& arena, int64_t id) const;

 private:
  std::vector<HostParam> params_;
  std::vector<HostLayer> layers_;
  std::vector<void*> registered_;  // host memory page-locked in place (kRegister)
};

}  // namespace roundpipe
