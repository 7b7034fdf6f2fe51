// Conversion between Python objects and c10::IValue trees.
#include "python/values.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>

#include "python/package_helpers.h"
#include "python/run_config.h"
#include "util/value_tree.h"

namespace roundpipe {
namespace python {
namespace {

// Python equality of two objects, false when == raises.
bool py_equal(const py::object& a, const py::object& b) {
  py::gil_scoped_acquire gil;
  if (a.is(b)) return true;
  try {
    return py::bool_(a.equal(b));
  } catch (py::error_already_set&) {
    return false;
  }
}

// An opaque Python leaf riding through the engine.
struct PyLeaf : OpaqueLeaf {
  explicit PyLeaf(SharedPyObject o) : obj(std::move(o)) {}
  bool equals(const OpaqueLeaf& other) const override {
    auto* o = dynamic_cast<const PyLeaf*>(&other);
    return o != nullptr && py_equal(obj.get(), o->obj.get());
  }
  SharedPyObject obj;
};

// The non-child part of a pytree node: its type and flatten context.
struct PyNode : OpaqueLeaf {
  PyNode(SharedPyObject t, SharedPyObject c) : node_type(std::move(t)), context(std::move(c)) {}
  bool equals(const OpaqueLeaf& other) const override {
    auto* o = dynamic_cast<const PyNode*>(&other);
    return o != nullptr && py_equal(node_type.get(), o->node_type.get()) &&
           py_equal(context.get(), o->context.get());
  }
  SharedPyObject node_type;
  SharedPyObject context;
};

template <typename T>
T* capsule_as(const c10::IValue& v) {
  if (!v.isCapsule()) return nullptr;
  return dynamic_cast<T*>(v.toCapsule().get());
}

bool all_str_keys(const py::dict& d) {
  for (auto item : d) {
    if (!PyUnicode_CheckExact(item.first.ptr())) return false;
  }
  return true;
}

c10::IValue opaque_leaf(const py::handle& obj) {
  return c10::IValue::make_capsule(
      c10::make_intrusive<PyLeaf>(SharedPyObject(py::reinterpret_borrow<py::object>(obj))));
}

}  // namespace

c10::IValue to_ivalue(const py::handle& obj) {
  PyObject* o = obj.ptr();
  if (THPVariable_Check(o)) return THPVariable_Unpack(o);
  if (o == Py_None) return c10::IValue();
  if (PyBool_Check(o)) return c10::IValue(o == Py_True);
  if (PyLong_CheckExact(o)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) return c10::IValue(static_cast<int64_t>(v));
    return opaque_leaf(obj);
  }
  if (PyFloat_CheckExact(o)) return c10::IValue(PyFloat_AS_DOUBLE(o));
  if (PyUnicode_CheckExact(o)) return c10::IValue(py::cast<std::string>(obj));
  if (PyTuple_CheckExact(o)) {
    std::vector<c10::IValue> items;
    for (auto item : py::reinterpret_borrow<py::tuple>(obj)) items.push_back(to_ivalue(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  if (PyList_CheckExact(o)) {
    c10::impl::GenericList list(c10::AnyType::get());
    for (auto item : py::reinterpret_borrow<py::list>(obj)) list.push_back(to_ivalue(item));
    return list;
  }
  if (PyDict_CheckExact(o) && all_str_keys(py::reinterpret_borrow<py::dict>(obj))) {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    for (auto item : py::reinterpret_borrow<py::dict>(obj)) {
      dict.insert(py::cast<std::string>(item.first), to_ivalue(item.second));
    }
    return dict;
  }
  if (py::isinstance<PyMicrobatchValues>(obj)) return py::cast<const PyMicrobatchValues&>(obj).value;
  py::object node = package_helpers().flatten_node(obj);
  if (!node.is_none()) {
    auto parts = node.cast<py::tuple>();  // (node_type, children, context)
    std::vector<c10::IValue> items;
    items.push_back(c10::IValue::make_capsule(c10::make_intrusive<PyNode>(
        SharedPyObject(py::reinterpret_borrow<py::object>(parts[0])),
        SharedPyObject(py::reinterpret_borrow<py::object>(parts[2])))));
    for (auto child : parts[1].cast<py::list>()) items.push_back(to_ivalue(child));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return opaque_leaf(obj);
}

py::object to_python(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return py::none();
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
  }
  if (v.isNone()) return py::none();
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isString()) return py::str(v.toStringRef());
  if (auto* leaf = capsule_as<PyLeaf>(v)) return leaf->obj.get();
  if (v.isTuple()) {
    const auto& elems = v.toTupleRef().elements();
    if (!elems.empty()) {
      if (auto* node = capsule_as<PyNode>(elems[0])) {
        py::list children;
        for (size_t i = 1; i < elems.size(); ++i) children.append(to_python(elems[i]));
        return package_helpers().unflatten_node(node->node_type.get(), children, node->context.get());
      }
    }
    py::tuple out(elems.size());
    for (size_t i = 0; i < elems.size(); ++i) out[i] = to_python(elems[i]);
    return std::move(out);
  }
  if (v.isList()) {
    py::list out;
    for (const c10::IValue& item : v.toListRef()) out.append(to_python(item));
    return std::move(out);
  }
  if (v.isGenericDict()) {
    py::dict out;
    for (const auto& item : v.toGenericDict()) out[to_python(item.key())] = to_python(item.value());
    return std::move(out);
  }
  if (as_microbatch_values(v)) return py::cast(PyMicrobatchValues{v});
  if (v.isDevice()) return py::module_::import("torch").attr("device")(v.toDevice().str());
  TORCH_CHECK_TYPE(false, "RoundPipe cannot pass a value of kind ", v.tagKind(), " to Python");
}

std::vector<c10::IValue> args_to_ivalues(const py::handle& args) {
  std::vector<c10::IValue> out;
  for (auto item : args) out.push_back(to_ivalue(item));
  return out;
}

Kwargs kwargs_to_ivalues(const py::handle& kwargs) {
  Kwargs out = make_kwargs();
  for (auto item : py::reinterpret_borrow<py::dict>(kwargs)) {
    TORCH_CHECK_TYPE(PyUnicode_Check(item.first.ptr()), "keyword argument names must be str");
    out.insert(py::cast<std::string>(item.first), to_ivalue(item.second));
  }
  return out;
}

py::tuple args_to_python(const std::vector<c10::IValue>& args) {
  py::tuple out(args.size());
  for (size_t i = 0; i < args.size(); ++i) out[i] = to_python(args[i]);
  return out;
}

py::dict kwargs_to_python(const Kwargs& kwargs) {
  py::dict out;
  for (const auto& item : kwargs) out[py::str(item.key())] = to_python(item.value());
  return out;
}

void bind_values(py::module_& m) {
  // The engine's automatic split and merge (roundpipe/microbatch.h), for
  // Python code that runs microbatches itself (AutoRoundPipe).
  m.def(
      "split_inputs",
      [](const py::tuple& args, const py::dict& kwargs, int64_t n, const py::object& run_config) {
        const InputSplit how =
            run_config.is_none() ? InputSplit() : to_run_config(run_config).split_input().value_or(InputSplit());
        const MicrobatchInputs split = split_inputs(args_to_ivalues(args), kwargs_to_ivalues(kwargs), n, how);
        py::list out;
        for (int64_t i = 0; i < n; ++i)
          out.append(py::make_tuple(args_to_python(split.args[i]), kwargs_to_python(split.kwargs[i])));
        return out;
      },
      py::arg("args"), py::arg("kwargs"), py::arg("n"), py::arg("run_config") = py::none(),
      "(args, kwargs) of each of n microbatches, split as a call's inputs are: by run_config's "
      "split_input when given, else automatically.");
  m.def(
      "split_label",
      [](const py::handle& label, int64_t n) {
        py::list out;
        for (const c10::IValue& piece : split_label(to_ivalue(label), n, LabelSplit()))
          out.append(to_python(piece));
        return out;
      },
      py::arg("label"), py::arg("n"),
      "The label of each of n microbatches, split as a call's label is by default.");
  m.def(
      "merge_outputs",
      [](const py::sequence& outputs) {
        std::vector<c10::IValue> values;
        for (const py::handle& o : outputs) values.push_back(to_ivalue(o));
        return to_python(merge_outputs(values, OutputMerge()));
      },
      py::arg("outputs"), "The microbatch outputs merged as a call's outputs are by default.");
  py::class_<PyMicrobatchValues>(m, "MicrobatchValues", R"(
Per-microbatch values of an output merged with merge_output=False: another
RoundPipe model accepts them as input and keeps the microbatches as they are.)")
      .def("__len__", [](const PyMicrobatchValues& self) {
        return as_microbatch_values(self.value)->items.size();
      })
      .def_property_readonly("items", [](const PyMicrobatchValues& self) {
        py::list out;
        for (const auto& item : as_microbatch_values(self.value)->items) out.append(to_python(item));
        return out;
      }, "The value of each microbatch, in order.")
      .def("__getitem__", [](const PyMicrobatchValues& self, py::object index) -> py::object {
        py::list items;
        for (const auto& item : as_microbatch_values(self.value)->items) items.append(to_python(item));
        return items.attr("__getitem__")(index);
      }, "Microbatch `index`'s value (an int or a slice), as a list would.")
      .def("__iter__", [](const PyMicrobatchValues& self) {
        py::list items;
        for (const auto& item : as_microbatch_values(self.value)->items) items.append(to_python(item));
        return items.attr("__iter__")();
      })
      .def("synchronize", [](py::object self) { return self; },
           "Returns itself: the values are complete when the call that made them returns.")
      .def("__repr__", [](const PyMicrobatchValues& self) {
        return "MicrobatchValues(" + std::to_string(as_microbatch_values(self.value)->items.size()) +
               " microbatches)";
      });
}

}  // namespace python
}  // namespace roundpipe
