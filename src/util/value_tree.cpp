#include "util/value_tree.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>

namespace roundpipe {
namespace {

// Rebuilds `value` with each tensor leaf replaced by leaf_fn(leaf).
c10::IValue rebuild(const c10::IValue& value, const std::function<at::Tensor(const at::Tensor&)>& leaf_fn) {
  if (value.isTensor()) return leaf_fn(value.toTensor());
  if (value.isTuple()) {
    std::vector<c10::IValue> items;
    for (const auto& item : value.toTupleRef().elements()) items.push_back(rebuild(item, leaf_fn));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  if (value.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : value.toTensorList()) out.push_back(leaf_fn(t));
    return out;
  }
  if (value.isList()) {
    auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    for (const c10::IValue& item : list) out.push_back(rebuild(item, leaf_fn));
    return out;
  }
  if (value.isGenericDict()) {
    auto dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& entry : dict) out.insert(entry.key(), rebuild(entry.value(), leaf_fn));
    return out;
  }
  return value;
}

void visit(const c10::IValue& value, std::vector<at::Tensor>& out) {
  if (value.isTensor()) {
    out.push_back(value.toTensor());
  } else if (value.isTuple()) {
    for (const auto& item : value.toTupleRef().elements()) visit(item, out);
  } else if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorList()) out.push_back(t);
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toList()) visit(item, out);
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) visit(entry.value(), out);
  }
}

}  // namespace

std::vector<at::Tensor> flatten_tensors(const c10::IValue& value) {
  std::vector<at::Tensor> out;
  visit(value, out);
  return out;
}

c10::IValue map_tensors(const c10::IValue& value, const std::function<at::Tensor(const at::Tensor&)>& fn) {
  return rebuild(value, fn);
}

c10::IValue clone_tensors(const c10::IValue& value) {
  return rebuild(value, [](const at::Tensor& t) { return t.defined() ? t.clone() : t; });
}

c10::IValue replace_tensors(const c10::IValue& value, const std::vector<at::Tensor>& tensors) {
  size_t next = 0;
  c10::IValue out = rebuild(value, [&](const at::Tensor&) {
    TORCH_INTERNAL_ASSERT(next < tensors.size());
    return tensors[next++];
  });
  TORCH_INTERNAL_ASSERT(next == tensors.size());
  return out;
}

c10::IValue tensors_to_ivalue(const std::vector<at::Tensor>& tensors) {
  c10::impl::GenericList out(c10::AnyType::get());
  for (const auto& t : tensors) out.push_back(t.defined() ? c10::IValue(t) : c10::IValue());
  return out;
}

std::vector<at::Tensor> tensors_from_ivalue(const c10::IValue& value) {
  std::vector<at::Tensor> out;
  for (const c10::IValue& item : value.toList()) out.push_back(item.isNone() ? at::Tensor() : item.toTensor());
  return out;
}

}  // namespace roundpipe
