#include "engine/host_store.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <unordered_map>
#include <utility>

#include "runtime/cuda_memory.h"
#include "runtime/host_memory.h"
#include "runtime/tensor_over.h"

namespace roundpipe {
namespace {

constexpr int64_t kAlign = 64;  // bytes; keeps every view vector-aligned

int64_t align_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

const char* pin_mode_name(PinMode mode) {
  switch (mode) {
    case PinMode::kAlloc: return "alloc";
    case PinMode::kRegister: return "register";
    case PinMode::kOff: return "off";
  }
  return "?";
}

PinMode pin_mode_from_name(const std::string& name) {
  for (PinMode mode : {PinMode::kAlloc, PinMode::kRegister, PinMode::kOff}) {
    if (name == pin_mode_name(mode)) return mode;
  }
  TORCH_CHECK_VALUE(false, "pin_model must be 'alloc', 'register' or 'off', got '", name, "'");
}

HostStore::HostStore(const std::vector<std::shared_ptr<LayerHandle>>& layers, PinMode mode,
                     bool page_lock) {
  std::unordered_map<const c10::TensorImpl*, int64_t> id_of;
  layers_.resize(layers.size());
  int64_t slab_bytes = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    HostLayer& hl = layers_[l];
    hl.slab_offset = slab_bytes;
    for (const auto& [name, tensor] : layers[l]->named_parameters()) {
      auto [it, is_new] = id_of.emplace(tensor.unsafeGetTensorImpl(), params_.size());
      if (is_new) {
        HostParam p;
        p.name = std::to_string(l) + "." + name;
        p.master = tensor;
        p.owner = static_cast<int64_t>(l);
        p.offset = hl.arena_bytes;
        hl.arena_bytes += align_up(tensor.numel() * static_cast<int64_t>(tensor.element_size()));
        hl.owned.push_back(it->second);
        params_.push_back(std::move(p));
      }
      hl.param_ids.push_back(it->second);
      hl.param_bytes += tensor.numel() * static_cast<int64_t>(tensor.element_size());
    }
    slab_bytes += hl.arena_bytes;
  }
  if (mode == PinMode::kAlloc) {
    // One slab of the exact size (rounded to the alignment only): no
    // power-of-two blow-up, which torch's pinned allocator would add, and
    // the layers of a stage are one range of it, uploaded in one copy.
    if (!page_lock) {
      slab_ = mapped_bytes(slab_bytes);
    } else if (cuda::built_with_cuda()) {
      slab_ = cuda::page_locked_bytes(slab_bytes);
    } else {  // another accelerator: its own pinned allocator
      slab_ = at::empty({slab_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    }
    for (HostLayer& hl : layers_) {
      hl.arena = slab_.narrow(0, hl.slab_offset, hl.arena_bytes);
      for (int64_t id : hl.owned) {
        HostParam& p = params_[id];
        at::Tensor view = view_in(hl.arena, id);
        view.copy_(p.master.detach());
        // The model keeps its parameter objects; their data now lives in the slab.
        p.master.set_data(view);
      }
    }
  }
  if (mode == PinMode::kRegister && page_lock && cuda::built_with_cuda()) {
    // The whole pages of every storage (tensors loaded from one file may
    // share a mapping, small ones share pages of the heap), each page once;
    // memory page-locked already stays as it is.
    std::vector<std::pair<uintptr_t, int64_t>> storages;
    for (const HostParam& p : params_) {
      const c10::Storage& storage = p.master.storage();
      if (storage.mutable_data() == nullptr) continue;
      storages.emplace_back(reinterpret_cast<uintptr_t>(storage.mutable_data()), static_cast<int64_t>(storage.nbytes()));
    }
    try {
      for (const auto& [address, bytes] : covering_pages(std::move(storages))) {
        void* data = reinterpret_cast<void*>(address);
        if (cuda::register_page_locked(data, bytes)) registered_.push_back(data);
      }
    } catch (...) {
      for (void* data : registered_) cuda::unregister_page_locked(data);
      throw;
    }
  }
}

HostStore::~HostStore() {
  for (void* data : registered_) cuda::unregister_page_locked(data);
}

at::Tensor HostStore::view_in(const at::Tensor& arena, int64_t id) const {
  const HostParam& p = params_.at(id);
  at::Tensor keep = arena;  // the view keeps the arena alive
  return at::from_blob(static_cast<uint8_t*>(arena.data_ptr()) + p.offset, p.master.sizes(),
                       [keep](void*) mutable { keep.reset(); },
                       p.master.options().device(arena.device()).requires_grad(false));
}

at::Tensor HostStore::view_on_device(const at::Tensor& bytes, int64_t arena_offset, int64_t id) const {
  const HostParam& p = params_.at(id);
  // bytes.narrow(0, offset, size).view(dtype).view(sizes), built directly
  // (tensor_over.h). Offsets are kAlign-aligned, so the element offset is exact.
  const int64_t byte_offset = bytes.storage_offset() + arena_offset + p.offset;
  return tensor_over(bytes, p.master.dtype(), byte_offset / static_cast<int64_t>(p.master.element_size()),
                     p.master.sizes());
}

std::vector<int64_t> HostStore::layer_param_bytes() const {
  std::vector<int64_t> out;
  for (const auto& l : layers_) out.push_back(l.param_bytes);
  return out;
}

}  // namespace roundpipe
