// The host-resident model state: master parameters (packed into one
// contiguous arena per layer, the arenas one slab in layer order, or left in
// place: PinMode), their optimizer copies, and buffers.
//
// Thread-compatible: owned by the user thread of the model; device workers
// only read arenas and buffers while a call runs (the user thread does not
// write them then).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/layer_handle.h"
#include "roundpipe/model.h"

namespace roundpipe {

// One unique parameter of the model (tied parameters appear once).
struct HostParam {
  std::string name;   // "<layer>.<name in layer>" where first found, e.g. "3.weight"
  at::Tensor master;  // the model's own parameter; its data views the owner's arena (if it has one)
  int64_t owner = 0;  // the first layer using it
  int64_t offset = 0; // byte offset in the owner's arena
  at::Tensor optim;   // optimizer copy [same shape] in optim dtype (trainable parameters only)
  bool trainable() const { return master.requires_grad(); }
};

struct HostLayer {
  std::vector<int64_t> param_ids;  // per layer parameter (named_parameters order) -> HostParam
  at::Tensor arena;                // uint8 [arena_bytes]: the parameters this layer owns, in the slab (kAlloc only)
  int64_t arena_bytes = 0;         // the size of `arena` (also when there is none)
  int64_t slab_offset = 0;         // where `arena` starts in the slab
  std::vector<int64_t> owned;      // HostParam ids first used by this layer (stored in `arena`)
  int64_t param_bytes = 0;         // bytes of all this layer's parameters (tied ones included)
};

class HostStore {
 public:
  // Keeps the layers' parameters as `mode` says; `page_lock` (the devices
  // are CUDA devices) page-locks them (kAlloc, kRegister).
  HostStore(const std::vector<std::shared_ptr<LayerHandle>>& layers, PinMode mode, bool page_lock);
  ~HostStore();
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  std::vector<HostParam>& params() { return params_; }
  const std::vector<HostParam>& params() const { return params_; }
  const HostLayer& layer(int64_t i) const { return layers_.at(i); }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  std::vector<int64_t> layer_param_bytes() const;
  // Every layer's arena in layer order, one allocation (kAlloc; undefined
  // otherwise).
  const at::Tensor& slab() const { return slab_; }

  // The tensor of parameter `id` inside its owner's host arena: a storage of
  // its own (from_blob, keeping the arena alive), so that the model's
  // parameters do not share memory in the eyes of savers such as safetensors.
  at::Tensor view_in(const at::Tensor& arena, int64_t id) const;
  // The same inside `bytes`, a device copy of a range of the slab in which
  // the owner's arena starts at byte `arena_offset`: a view of its storage,
  // so the device allocator sees the copy in use for as long as any
  // parameter is.
  at::Tensor view_on_device(const at::Tensor& bytes, int64_t arena_offset, int64_t id) const;

 private:
  std::vector<HostParam> params_;
  std::vector<HostLayer> layers_;
  at::Tensor slab_;                // uint8: the arenas (kAlloc)
  std::vector<void*> registered_;  // host memory page-locked in place (kRegister)
};

}  // namespace roundpipe
