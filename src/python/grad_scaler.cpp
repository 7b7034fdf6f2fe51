// roundpipe.GradScaler's thread-safe core (roundpipe::GradScaler), and the
// optimizer-thread helpers the Python class uses to run its optimizer-side
// methods where the optimizer state lives.
#include "engine/engine_access.h"
#include "python/python_common.h"
#include "roundpipe/grad_scaler.h"
#include "roundpipe/microbatch.h"

namespace roundpipe {
namespace python {
namespace {

std::vector<at::Tensor> tensors(const py::list& list) {
  std::vector<at::Tensor> out;
  for (auto item : list) out.push_back(THPVariable_Unpack(item.ptr()));
  return out;
}

py::dict to_dict(const c10::Dict<std::string, c10::IValue>& d) {
  py::dict out;
  for (const auto& item : d) {
    const c10::IValue& v = item.value();
    if (v.isDouble()) {
      out[py::str(item.key())] = v.toDouble();
    } else if (v.isInt()) {
      out[py::str(item.key())] = v.toInt();
    } else {
      out[py::str(item.key())] = py::str(v.tagKind());
    }
  }
  return out;
}

}  // namespace

void bind_grad_scaler(py::module_& m) {
  py::class_<GradScaler>(m, "GradScalerCore")
      .def(py::init([](double init_scale, double growth_factor, double backoff_factor, int64_t growth_interval,
                       bool enabled) {
        return std::make_unique<GradScaler>(GradScalerOptions()
                                                .set_init_scale(init_scale)
                                                .set_growth_factor(growth_factor)
                                                .set_backoff_factor(backoff_factor)
                                                .set_growth_interval(growth_interval)
                                                .set_enabled(enabled));
      }))
      .def("get_scale", &GradScaler::get_scale)
      .def("unscale_grads",
           [](GradScaler& self, uintptr_t key, const py::list& grads) {
             auto g = tensors(grads);
             py::gil_scoped_release nogil;
             self.unscale_grads(key, g);
           })
      .def("prepare_step",
           [](GradScaler& self, uintptr_t key, const py::list& grads) {
             auto g = tensors(grads);
             py::gil_scoped_release nogil;
             return self.prepare_step(key, g);
           })
      .def("update",
           [](GradScaler& self, c10::optional<double> new_scale, bool is_async) {
             py::gil_scoped_release nogil;
             self.update(new_scale, is_async);
           })
      .def("get_growth_factor", &GradScaler::get_growth_factor)
      .def("set_growth_factor", &GradScaler::set_growth_factor)
      .def("get_backoff_factor", &GradScaler::get_backoff_factor)
      .def("set_backoff_factor", &GradScaler::set_backoff_factor)
      .def("get_growth_interval", &GradScaler::get_growth_interval)
      .def("set_growth_interval", &GradScaler::set_growth_interval)
      .def("is_enabled", &GradScaler::is_enabled)
      .def("state_dict", [](const GradScaler& self) { return to_dict(self.state_dict()); })
      .def("load_state_dict", [](GradScaler& self, const py::dict& state) {
        c10::Dict<std::string, c10::IValue> d = make_kwargs();
        for (auto item : state) {
          const std::string key = py::str(item.first);
          py::handle v = item.second;
          if (THPVariable_Check(v.ptr())) v = v.attr("item")();
          if (PyBool_Check(v.ptr())) {
            d.insert(key, c10::IValue(v.cast<bool>()));
          } else if (PyLong_Check(v.ptr())) {
            d.insert(key, c10::IValue(v.cast<int64_t>()));
          } else if (PyFloat_Check(v.ptr())) {
            d.insert(key, c10::IValue(v.cast<double>()));
          } else {
            TORCH_CHECK_TYPE(false, "GradScaler.load_state_dict: '", key, "' must be a number");
          }
        }
        self.load_state_dict(d);
      });

  m.def("on_optimizer_thread", &on_optimizer_thread);
  m.def("run_on_optimizer_thread", [](const py::object& fn) {
    SharedPyObject f(fn);
    py::gil_scoped_release nogil;
    run_on_optimizer_thread([f] { call_python([&] { f.get()(); }); });
  });
}

}  // namespace python
}  // namespace roundpipe
