// roundpipe._C: the engine for Python. The Python package (python/roundpipe)
// builds the documented API on these bindings.
#include <torch/csrc/Dtype.h>

#include <functional>
#include <memory>

#include "engine/engine_access.h"
#include "python/engine.h"
#include "python/native_module.h"
#include "python/package_helpers.h"
#include "python/py_layer.h"
#include "python/python_common.h"
#include "python/run_config.h"
#include "python/values.h"
#include "util/file_error.h"
#include "roundpipe/auto_plan.h"
#include "roundpipe/devices.h"
#include "roundpipe/model.h"
#include "roundpipe/optimizer.h"
#include "roundpipe/recompute.h"
#include "roundpipe/timer.h"
#include "roundpipe/trace.h"

namespace roundpipe {
namespace python {

void bind_optim(py::module_& m);
void bind_grad_scaler(py::module_& m);
void bind_safetensors(py::module_& m);
void bind_token_data(py::module_& m);
void bind_checkpoint(py::module_& m);
void bind_distributed(py::module_& m);

namespace {

RunKind run_kind(const std::string& kind) {
  TORCH_CHECK_VALUE(kind == "infer" || kind == "train" || kind == "fused",
                    "run_type must be 'infer', 'train' or 'fused', got '", kind, "'");
  return kind == "infer" ? RunKind::kInfer : kind == "train" ? RunKind::kTrain : RunKind::kFused;
}

// A RoundPipe model driven from Python.
class Engine {
 public:
  Engine(const py::list& modules, const std::string& name, const py::object& optim_dtype,
         const py::object& run_config, const py::object& process_group, const std::string& gradient_reduction,
         const std::string& pin_model, bool overlap_iterations, const py::object& sync_warmup_steps) {
    RoundPipeOptions options;
    options.name = name;
    options.overlap_iterations = overlap_iterations;
    if (!sync_warmup_steps.is_none()) options.sync_warmup_steps = sync_warmup_steps.cast<int64_t>();
    options.pin_model = pin_mode_from_name(pin_model);
    if (!process_group.is_none()) options.process_group = process_group.cast<std::shared_ptr<ProcessGroup>>();
    TORCH_CHECK_VALUE(gradient_reduction == "sum" || gradient_reduction == "mean",
                      "RoundPipe: gradient_reduction must be 'sum' or 'mean', got '", gradient_reduction, "'");
    options.gradient_reduction = gradient_reduction == "sum" ? GradientReduction::kSum : GradientReduction::kMean;
    options.run_config = to_run_config(run_config);
    if (!optim_dtype.is_none()) {
      TORCH_CHECK_TYPE(THPDtype_Check(optim_dtype.ptr()), "optim_dtype must be a torch.dtype or None");
      options.optim_dtype = reinterpret_cast<THPDtype*>(optim_dtype.ptr())->scalar_type;
    }
    std::vector<std::shared_ptr<LayerHandle>> layers(modules.size());
    std::vector<std::pair<size_t, torch::nn::AnyModule>> natives;
    for (size_t i = 0; i < modules.size(); ++i) {
      if (auto native = native_module_of(modules[i])) {
        natives.emplace_back(i, std::move(*native));
        continue;
      }
      auto layer = make_py_layer(modules[i], static_cast<int64_t>(i));
      py_layers_.push_back(layer);
      layers[i] = std::move(layer);
    }
    // Lock order: the generator lock (taken to clone native layers, and by
    // the engine's constructor) is never taken while holding the GIL.
    py::gil_scoped_release nogil;
    for (auto& [i, any] : natives) layers[i] = make_module_layer(std::move(any), static_cast<int64_t>(i));
    model_ = std::make_unique<RoundPipe>(
        detail::EngineAccess::from_layers(std::move(layers), std::move(options)));
  }

  ~Engine() {
    // A closed engine (every engine once the interpreter exits) has nothing
    // to wait for: it leaves the GIL alone, which an engine thread could not
    // take back while the interpreter finalizes.
    if (model_ == nullptr) return;
    // Device and optimizer threads may need the GIL to finish their work.
    py::gil_scoped_release nogil;
    model_.reset();
  }

  py::object forward(const py::tuple& args, const py::dict& kwargs, const py::object& run_config) {
    RunConfig cfg = prepare(run_config);
    auto a = args_to_ivalues(args);
    auto k = kwargs_to_ivalues(kwargs);
    c10::IValue out;
    {
      InterruptScope interrupts(poll_python_signals);
      py::gil_scoped_release nogil;
      out = model().forward(std::move(a), std::move(k), cfg);
    }
    return to_python(out);
  }

  py::object forward_backward(const py::tuple& args, const py::dict& kwargs, const py::object& label,
                              const py::object& loss_fn, bool return_outputs, const py::object& run_config) {
    RunConfig cfg = prepare(run_config);
    auto a = args_to_ivalues(args);
    auto k = kwargs_to_ivalues(kwargs);
    c10::IValue l = to_ivalue(label);
    TORCH_CHECK_TYPE(PyCallable_Check(loss_fn.ptr()), "forward_backward: loss_fn must be callable");
    SharedPyObject fn(loss_fn);
    LossFn wrapped = [fn](const c10::IValue& outputs, const c10::IValue& labels) {
      return call_python([&] { return to_ivalue(fn.get()(to_python(outputs), to_python(labels))); });
    };
    c10::IValue out;
    {
      InterruptScope interrupts(poll_python_signals);
      py::gil_scoped_release nogil;
      out = model().forward_backward(std::move(a), std::move(k), std::move(l), wrapped, return_outputs, cfg);
    }
    return to_python(out);
  }

  void step(const py::object& step_fn, bool is_async) {
    TORCH_CHECK_TYPE(PyCallable_Check(step_fn.ptr()), "step: step_fn must be callable");
    SharedPyObject fn(step_fn);
    StepFn wrapped = [fn] { call_python([&] { fn.get()(); }); };
    InterruptScope interrupts(poll_python_signals);
    py::gil_scoped_release nogil;
    model().step(std::move(wrapped), is_async);
  }

  void synchronize() {
    InterruptScope interrupts(poll_python_signals);
    py::gil_scoped_release nogil;
    model().synchronize();
  }

  // Until the parameters hold what the latest step published (before
  // Python reads them: state_dict(), parameters()).
  void wait_published() {
    py::gil_scoped_release nogil;
    model().state_dict();  // waits for that
  }

  void refresh_optimizer_copies() {
    py::gil_scoped_release nogil;
    model().refresh_optimizer_copies();
  }

  py::list optim_named_parameters() {
    py::list out;
    for (auto& [name, t] : model().optim_named_parameters()) out.append(py::make_tuple(name, t));
    return out;
  }

  void train(bool on) {
    for (auto& l : py_layers_) l->refresh_mode();
    model().train(on);
  }

  int64_t num_devices() { return model().num_devices(); }

  py::object default_execute_plan(const std::string& kind) {
    return plan_to_python(model().default_execute_plan(run_kind(kind)));
  }

  // {"fwd_ms": [...], "recompute_ms": [...], "bwd_ms": [...], "param_bytes": [...]}
  py::dict layer_costs() {
    const LayerCosts c = model().layer_costs();
    py::dict out;
    out["fwd_ms"] = c.fwd_ms;
    out["recompute_ms"] = c.recompute_ms;
    out["bwd_ms"] = c.bwd_ms;
    out["param_bytes"] = c.param_bytes;
    return out;
  }

  // The timer's estimate (ms) of `action` ("fwd", "re", "bwd") on `layer`, or None.
  py::object timer_estimate(int64_t layer, const std::string& action) {
    c10::optional<double> ms = model().timer().estimate(layer, to_action(action));
    return ms ? py::cast(*ms) : py::none();
  }
  int64_t timer_records(int64_t layer, const std::string& action) {
    return model().timer().num_records(layer, to_action(action));
  }
  void timer_reset() { model().timer().reset(); }

  void close() {
    py::gil_scoped_release nogil;
    model_.reset();
  }

  RoundPipe& model() {
    TORCH_CHECK(model_ != nullptr, "this RoundPipe model was closed");
    return *model_;
  }

 private:
  static LayerAction to_action(const std::string& action) {
    if (action == "fwd") return LayerAction::kForward;
    if (action == "re") return LayerAction::kRecompute;
    TORCH_CHECK_VALUE(action == "bwd", "action must be 'fwd', 're' or 'bwd', got '", action, "'");
    return LayerAction::kBackward;
  }


  // The call's run config, and the layers' training flags as the user left them.
  RunConfig prepare(const py::object& run_config) {
    for (auto& l : py_layers_) l->refresh_mode();
    return to_run_config(run_config);
  }

  std::vector<std::shared_ptr<PyLayer>> py_layers_;
  std::unique_ptr<RoundPipe> model_;
};

}  // namespace

RoundPipe& engine_model(const py::handle& engine, const char* who) {
  TORCH_CHECK_TYPE(py::isinstance<Engine>(engine), who, ": expected a RoundPipe model's engine, got ",
                   py::str(py::type::of(engine).attr("__name__")).cast<std::string>());
  try {
    return engine.cast<Engine&>().model();
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, who, ": ", e.what_without_backtrace());
  }
}

namespace {

// ModelExecutePlan.auto over the engines' timings (parameter sizes until
// timings exist), planned jointly.
std::vector<const RoundPipe*> models_of(const std::vector<Engine*>& engines, const char* who) {
  std::vector<const RoundPipe*> models;
  for (Engine* e : engines) {
    TORCH_CHECK_VALUE(e != nullptr, who, ": a model is None");
    models.push_back(&e->model());
  }
  return models;
}

py::list auto_execute_plans_py(const std::string& kind, const std::vector<Engine*>& engines, int64_t min_stages,
                               double upper_threshold, int64_t memory_limit_bytes) {
  AutoPlanOptions options;
  options.run_kind = run_kind(kind);
  options.min_stages = min_stages;
  options.upper_threshold = upper_threshold;
  options.model_memory_limit_bytes = memory_limit_bytes;
  py::list out;
  for (const auto& plan : auto_execute_plans(models_of(engines, "ModelExecutePlan.auto"), options)) {
    out.append(plan_to_python(plan));
  }
  return out;
}

void save_timings_py(const std::string& path, const std::vector<Engine*>& engines) {
  save_timings(path, models_of(engines, "save_timings"));
}

void translate_errors(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (::python_error& e) {
    e.restore();
  } catch (const c10::IndexError& e) {
    PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::NotImplementedError& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
  } catch (const FileError& e) {
    // OSError(errno, message, filename): Python picks the subclass
    // (FileNotFoundError, PermissionError, ...) from the errno.
    py::object error = py::reinterpret_borrow<py::object>(PyExc_OSError)(
        e.error_number(), std::string(e.what_without_backtrace()), e.path());
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  }
}

// A thread holding the GIL must not wait for engine threads (their Python
// work needs it): a model released there is destroyed by the reaper.
bool holds_gil() { return Py_IsInitialized() && PyGILState_Check() == 1; }

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "The roundpipe engine (C++); use the roundpipe package.";
  set_wait_forbidden_check(&holds_gil);
  py::register_exception_translator(&translate_errors);
  bind_package_helpers(m);
  bind_values(m);
  bind_optim(m);
  bind_grad_scaler(m);
  bind_safetensors(m);
  bind_token_data(m);
  bind_presets(m);
  bind_checkpoint(m);
  bind_distributed(m);

  py::class_<Engine>(m, "Engine")
      .def(py::init<const py::list&, const std::string&, const py::object&, const py::object&,
                    const py::object&, const std::string&, const std::string&, bool, const py::object&>())
      .def("forward", &Engine::forward)
      .def("forward_backward", &Engine::forward_backward)
      .def("step", &Engine::step)
      .def("synchronize", &Engine::synchronize)
      .def("wait_published", &Engine::wait_published)
      .def("refresh_optimizer_copies", &Engine::refresh_optimizer_copies)
      .def("optim_named_parameters", &Engine::optim_named_parameters)
      .def("train", &Engine::train)
      .def("num_devices", &Engine::num_devices)
      .def("default_execute_plan", &Engine::default_execute_plan)
      .def("layer_costs", &Engine::layer_costs)
      .def("timer_estimate", &Engine::timer_estimate)
      .def("timer_records", &Engine::timer_records)
      .def("timer_reset", &Engine::timer_reset)
      .def("close", &Engine::close);

  m.def("auto_execute_plans", &auto_execute_plans_py);
  m.def("save_timings", &save_timings_py, py::call_guard<py::gil_scoped_release>());
  m.def("set_timer_verbose", &ModelTimer::set_verbose);
  m.def("timer_verbose", &ModelTimer::verbose);
  m.def("start_trace", &start_trace, py::call_guard<py::gil_scoped_release>());
  m.def("stop_trace", &stop_trace, py::call_guard<py::gil_scoped_release>());
  m.def("tracing", &tracing);
  m.def("get_num_devices", &get_num_devices, py::call_guard<py::gil_scoped_release>());
  m.def("get_device_names", &get_device_names, py::call_guard<py::gil_scoped_release>());
  // One dict per device of the pool, in pool order.
  m.def("device_memory_stats", [] {
    std::vector<DeviceMemoryStats> stats;
    {
      py::gil_scoped_release release;
      stats = device_memory_stats();
    }
    py::list out;
    for (const auto& s : stats) {
      py::dict d;
      d["device"] = s.device;
      d["allocated_bytes"] = s.allocated_bytes;
      d["max_allocated_bytes"] = s.max_allocated_bytes;
      d["max_reserved_bytes"] = s.max_reserved_bytes;
      out.append(std::move(d));
    }
    return out;
  });
  m.def("reset_peak_device_memory", &reset_peak_device_memory, py::call_guard<py::gil_scoped_release>());
  m.def("wait_for_pending_destructions", &wait_for_pending_destructions,
        py::call_guard<py::gil_scoped_release>());
  m.def("close_engine_threads_gate", &close_engine_threads_gate,
        py::call_guard<py::gil_scoped_release>());
  m.def("set_sync_warmup_steps", &set_sync_warmup_steps);
  m.def("get_sync_warmup_steps", &get_sync_warmup_steps);

  py::class_<OptimizerCtx>(m, "_OptimizerCtxGuard").def(py::init<>());
  m.def("optimizer_ctx_active", &OptimizerCtx::active);

  m.def("save_for_recompute", [](const py::tuple& data) { save_for_recompute(args_to_ivalues(data)); });
  m.def("doing_recompute", &doing_recompute);
  m.def("get_recompute_data", [] { return args_to_python(get_recompute_data()); });
}

}  // namespace python
}  // namespace roundpipe
