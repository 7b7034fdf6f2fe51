// A contiguous tensor over part of another tensor's storage, built directly
// rather than with dispatched view ops (narrow, view, set_): the engine makes
// one per parameter of every stage upload and per small tensor of every
// download, where dispatched ops cost more than a small tensor's copy. The
// result is not a view in autograd's sense: like any tensor of its own it
// may be detached or changed in place, also as the output of an autograd
// function or a parameter's .grad.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

namespace roundpipe {

// `sizes` elements of `dtype`, contiguous, from element `element_offset` of
// `base`'s storage (counted in `dtype`'s elements), on `base`'s device.
inline at::Tensor tensor_over(const at::Tensor& base, caffe2::TypeMeta dtype, int64_t element_offset,
                              at::IntArrayRef sizes) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), dtype);
  impl->set_storage_offset(element_offset);
  impl->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(impl));
}

}  // namespace roundpipe
