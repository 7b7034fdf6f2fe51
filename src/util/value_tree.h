// Walking c10::IValue trees (tuples, lists, dicts; everything else a leaf).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <vector>

namespace roundpipe {

// Tensor leaves in depth-first order (dict entries in insertion order).
std::vector<at::Tensor> flatten_tensors(const c10::IValue& value);

// The same structure with every tensor leaf replaced by fn(leaf).
c10::IValue map_tensors(const c10::IValue& value, const std::function<at::Tensor(const at::Tensor&)>& fn);

// The same structure with every tensor leaf cloned (its own memory).
c10::IValue clone_tensors(const c10::IValue& value);

// The same structure with tensor leaves taken, in flatten_tensors order, from
// `tensors` (which must hold exactly as many).
c10::IValue replace_tensors(const c10::IValue& value, const std::vector<at::Tensor>& tensors);

// Undefined tensors travel as None inside IValue lists.
c10::IValue tensors_to_ivalue(const std::vector<at::Tensor>& tensors);
std::vector<at::Tensor> tensors_from_ivalue(const c10::IValue& value);

// A leaf carried as an IValue Capsule by a language binding (e.g. a Python
// object). Merging compares such leaves across microbatches with equals().
struct OpaqueLeaf : torch::CustomClassHolder {
  virtual bool equals(const OpaqueLeaf& other) const = 0;
};

}  // namespace roundpipe
