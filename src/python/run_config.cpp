// Run configuration, split/merge specs and functions from Python.
#include "python/run_config.h"

#include "python/package_helpers.h"
#include "python/values.h"

namespace roundpipe {
namespace python {
namespace {

bool is_replicate(const py::handle& obj) {
  // roundpipe.microbatch.Replicate, torch's, as the class or an instance.
  py::handle type = PyType_Check(obj.ptr()) ? obj : py::type::handle_of(obj);
  const std::string name = py::str(type.attr("__name__"));
  return name == "Replicate" || name == "_Replicate";
}

// A split/merge function rather than a spec (spec objects may be callable).
bool is_function(const py::handle& obj) {
  return PyCallable_Check(obj.ptr()) && !py::hasattr(obj, "split_dim") && !is_replicate(obj) &&
         !py::hasattr(obj, "reduce_fn");
}

Spec to_spec(const py::handle& obj, const std::string& where) {
  if (obj.is_none()) return Spec();
  if (PyTuple_Check(obj.ptr()) && !py::hasattr(obj, "_fields")) {
    std::vector<Spec> items;
    for (auto item : obj) items.push_back(to_spec(item, where));
    return Spec::tuple(std::move(items));
  }
  if (PyList_Check(obj.ptr())) {
    std::vector<Spec> items;
    for (auto item : obj) items.push_back(to_spec(item, where));
    return Spec::list(std::move(items));
  }
  if (PyDict_Check(obj.ptr())) {
    std::vector<std::pair<std::string, Spec>> items;
    for (auto item : py::reinterpret_borrow<py::dict>(obj)) {
      items.emplace_back(py::str(item.first), to_spec(item.second, where));
    }
    return Spec::dict(std::move(items));
  }
  if (is_replicate(obj)) return Replicate();
  if (py::hasattr(obj, "split_dim")) return TensorChunkSpec(obj.attr("split_dim").cast<int64_t>());
  if (py::hasattr(obj, "reduce_fn") && py::hasattr(obj, "init_value")) {
    SharedPyObject fn(py::reinterpret_borrow<py::object>(obj.attr("reduce_fn")));
    return CustomReducer(to_ivalue(obj.attr("init_value")), [fn](const c10::IValue& acc, const c10::IValue& x) {
      return call_python([&] { return to_ivalue(fn.get()(to_python(acc), to_python(x))); });
    });
  }
  TORCH_CHECK_TYPE(false, where, ": a spec leaf must be None, TensorChunkSpec, Replicate or CustomReducer, got ",
                   std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
}

template <typename T>
c10::optional<T> field(const py::handle& config, const char* name) {
  py::object v = config.attr(name);
  if (v.is_none()) return c10::nullopt;
  try {
    return v.cast<T>();
  } catch (py::cast_error&) {
    TORCH_CHECK_TYPE(false, "RoundPipeRunConfig.", name, ": expected ", py::type_id<T>(), ", got ",
                     std::string(py::str(py::type::handle_of(v).attr("__name__"))));
  }
}

InputSplit to_input_split(const py::object& v) {
  InputSplit how;
  if (is_function(v)) {
    SharedPyObject fn(v);
    const std::string name = callable_name(v);
    how.fn = [fn, name](const std::vector<c10::IValue>& args, const Kwargs& kwargs, int64_t n) {
      return call_python([&] {
        py::object out = fn.get()(args_to_python(args), kwargs_to_python(kwargs), n);
        TORCH_CHECK_VALUE(py::isinstance<py::sequence>(out) && py::len(out) == 2, "split_input function '",
                          name, "' must return (args_list, kwargs_list)");
        py::sequence parts = out;
        MicrobatchInputs result;
        for (auto a : parts[0].cast<py::sequence>()) result.args.push_back(args_to_ivalues(a));
        for (auto k : parts[1].cast<py::sequence>()) result.kwargs.push_back(kwargs_to_ivalues(k));
        TORCH_CHECK_VALUE(static_cast<int64_t>(result.args.size()) == n &&
                              static_cast<int64_t>(result.kwargs.size()) == n,
                          "split_input function '", name, "' returned ", result.args.size(), " args and ",
                          result.kwargs.size(), " kwargs entries for ", n, " microbatches");
        return result;
      });
    };
    return how;
  }
  TORCH_CHECK_TYPE(PyTuple_Check(v.ptr()) && py::len(v) == 2,
                   "RoundPipeRunConfig.split_input: expected a function or (args_spec, kwargs_spec)");
  py::tuple parts = v;
  if (!parts[0].is_none()) {
    std::vector<Spec> specs;
    for (auto s : parts[0]) specs.push_back(to_spec(s, "split_input args_spec"));
    how.args_spec = std::move(specs);
  }
  if (!parts[1].is_none()) {
    TORCH_CHECK_TYPE(PyDict_Check(parts[1].ptr()), "split_input kwargs_spec must be a dict or None");
    std::vector<std::pair<std::string, Spec>> specs;
    for (auto item : parts[1].cast<py::dict>()) {
      specs.emplace_back(py::str(item.first), to_spec(item.second, "split_input kwargs_spec"));
    }
    how.kwargs_spec = std::move(specs);
  }
  return how;
}

LabelSplit to_label_split(const py::object& v) {
  LabelSplit how;
  if (is_function(v)) {
    SharedPyObject fn(v);
    const std::string name = callable_name(v);
    how.fn = [fn, name](const c10::IValue& label, int64_t n) {
      return call_python([&] {
        std::vector<c10::IValue> out;
        for (auto item : fn.get()(to_python(label), n).cast<py::sequence>()) out.push_back(to_ivalue(item));
        TORCH_CHECK_VALUE(static_cast<int64_t>(out.size()) == n, "split_label function '", name, "' returned ",
                          out.size(), " labels for ", n, " microbatches");
        return out;
      });
    };
  } else {
    how.spec = to_spec(v, "split_label");
  }
  return how;
}

OutputMerge to_output_merge(const py::object& v) {
  OutputMerge how;
  if (PyBool_Check(v.ptr())) {
    how.merge = v.cast<bool>();
  } else if (is_function(v)) {
    SharedPyObject fn(v);
    how.fn = [fn](const std::vector<c10::IValue>& outputs) {
      return call_python([&] {
        py::list items;
        for (const auto& o : outputs) items.append(to_python(o));
        return to_ivalue(fn.get()(items));
      });
    };
  } else {
    how.spec = to_spec(v, "merge_output");
  }
  return how;
}

}  // namespace

ModelExecutePlan to_plan(const py::handle& plan) {
  TORCH_CHECK_TYPE(py::hasattr(plan, "fwd_plan") && py::hasattr(plan, "bwd_plan"),
                   "execute_plan must be a roundpipe.ModelExecutePlan, got ", py::type::of(plan).attr("__name__").cast<std::string>());
  ModelExecutePlan out;
  auto ranges = [](const py::handle& list, const char* name) {
    std::vector<LayerRange> result;
    for (auto r : list) {
      TORCH_CHECK_TYPE(PyRange_Check(r.ptr()), "ModelExecutePlan.", name, ": entries must be range objects");
      TORCH_CHECK_VALUE(r.attr("step").cast<int64_t>() == 1, "ModelExecutePlan.", name,
                        ": ranges must have step 1");
      result.push_back({r.attr("start").cast<int64_t>(), r.attr("stop").cast<int64_t>()});
    }
    return result;
  };
  out.fwd_plan = ranges(plan.attr("fwd_plan"), "fwd_plan");
  out.bwd_plan = ranges(plan.attr("bwd_plan"), "bwd_plan");
  return out;
}

py::object plan_to_python(const ModelExecutePlan& plan) {
  auto ranges = [](const std::vector<LayerRange>& list) {
    py::list out;
    for (const auto& r : list) out.append(py::module_::import("builtins").attr("range")(r.begin, r.end));
    return out;
  };
  return package_helpers().execute_plan(ranges(plan.fwd_plan), ranges(plan.bwd_plan));
}

RunConfig to_run_config(const py::handle& config) {
  RunConfig out;
  if (config.is_none()) return out;
  if (auto v = field<int64_t>(config, "num_microbatch")) out.num_microbatch(*v);
  if (auto v = field<std::string>(config, "recompute_grain")) {
    TORCH_CHECK_VALUE(*v == "stage" || *v == "layer",
                      "RoundPipeRunConfig.recompute_grain must be 'stage' or 'layer', got '", *v, "'");
    out.recompute_grain(*v == "stage" ? RecomputeGrain::kStage : RecomputeGrain::kLayer);
  }
  py::object device = config.attr("output_device");
  if (!device.is_none()) {
    const std::string name = py::str(py::module_::import("torch").attr("device")(device));
    out.output_device(c10::Device(name));
  }
  if (auto v = field<bool>(config, "preserve_rng_state")) out.preserve_rng_state(*v);
  if (auto v = field<bool>(config, "requires_grad")) out.requires_grad(*v);
  py::object v = config.attr("split_input");
  if (!v.is_none()) out.split_input(to_input_split(v));
  v = config.attr("split_label");
  if (!v.is_none()) out.split_label(to_label_split(v));
  v = config.attr("merge_output");
  if (!v.is_none()) out.merge_output(to_output_merge(v));
  v = config.attr("execute_plan");
  if (!v.is_none()) out.execute_plan(to_plan(v));
  return out;
}

}  // namespace python
}  // namespace roundpipe
