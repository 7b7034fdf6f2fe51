// Exact detection of buffer writes (buffer_watch.h).
#include "engine/buffer_watch.h"

#include <ATen/ATen.h>
#include <c10/core/impl/COW.h>

namespace roundpipe {
namespace {

// A copy-on-write clone can watch it: dense, with memory of its own kind
// (c10::impl::cow::lazy_clone_storage refuses a DataPtr with another context).
bool can_watch(const at::Tensor& t) {
  return t.layout() == at::kStrided && !t.is_quantized() && t.nbytes() > 0 &&
         c10::impl::cow::has_simple_data_ptr(*t.storage().unsafeGetStorageImpl());
}

bool same_tensor(const at::Tensor& a, const at::Tensor& b) {
  return a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl() &&
         a.dtype() == b.dtype() && a.sizes().equals(b.sizes()) && a.strides().equals(b.strides()) &&
         a.storage_offset() == b.storage_offset();
}

}  // namespace

std::vector<at::Tensor> BufferWatch::watch(const std::vector<at::Tensor>& uploaded) {
  at::NoGradGuard no_grad;
  bound_.clear();
  for (const at::Tensor& u : uploaded) {
    if (!u.defined() || u.nbytes() == 0) {
      bound_.push_back(u);  // no data to write; a replacement still shows
      continue;
    }
    // Memory nobody else holds (the upload's may still be held by its
    // lane): the clone alone shares it, so a first write takes it over
    // without a copy, which on an accelerator would not be ordered on the
    // device's streams.
    at::Tensor own = u.clone();
    bound_.push_back(can_watch(own) ? at::_lazy_clone(own) : own);
  }
  return bound_;
}

std::vector<char> BufferWatch::written(const std::vector<at::Tensor>& now) const {
  TORCH_INTERNAL_ASSERT(now.size() == bound_.size());
  std::vector<char> out(now.size(), 0);
  for (size_t i = 0; i < now.size(); ++i) {
    const at::Tensor& b = bound_[i];
    const at::Tensor& n = now[i];
    if (!b.defined() || !n.defined()) {
      out[i] = b.defined() != n.defined();
      continue;
    }
    // Unwatched memory (of another kind) counts as written: a write-back
    // costs time, a missed write a wrong value.
    const bool untouched =
        b.nbytes() == 0 || c10::impl::cow::is_cow_data_ptr(b.storage().data_ptr());
    out[i] = !(untouched && same_tensor(n, b));
  }
  return out;
}

}  // namespace roundpipe
