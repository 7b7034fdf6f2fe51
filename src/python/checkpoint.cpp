// Checkpoints for Python (python/roundpipe/checkpoint.py): the engine's state
// is saved and restored here; the Python optimizer's and scaler's state
// travels as opaque bytes inside the same file. Each function takes the
// model's engine object (roundpipe._C.Engine).
#include "engine/engine_access.h"
#include "python/engine.h"
#include "python/python_common.h"

namespace roundpipe {
namespace python {
namespace {

std::shared_ptr<RoundPipe::Impl> model_of(const py::handle& engine, const char* who) {
  return detail::EngineAccess::impl(engine_model(engine, who));
}

}  // namespace

void bind_checkpoint(py::module_& m) {
  // Waits for the model's queued optimizer work (so its optimizer's state can
  // be read) without publishing the newest step into the model's parameters.
  m.def("checkpoint_drain", [](const py::object& engine) {
    auto model = model_of(engine, "save_checkpoint");
    InterruptScope interrupts(poll_python_signals);
    py::gil_scoped_release nogil;  // a step_fn may need the GIL
    detail::quiesce_for_checkpoint(*model);
  });
  m.def("save_checkpoint", [](const std::string& path, const py::object& engine, int64_t step,
                              const std::string& metadata_json, const py::bytes& extra) {
    auto model = model_of(engine, "save_checkpoint");
    const std::string blob = extra;
    CheckpointState state;
    state.step = step;
    state.metadata_json = metadata_json;
    InterruptScope interrupts(poll_python_signals);
    py::gil_scoped_release nogil;
    detail::save_checkpoint_with(path, *model, state, &blob);
  });
  py::class_<detail::PendingCheckpoint>(m, "PendingCheckpoint")
      .def_property_readonly("step", [](const detail::PendingCheckpoint& p) { return p.step; })
      .def_property_readonly("metadata_json", [](const detail::PendingCheckpoint& p) { return p.metadata_json; })
      .def_property_readonly("extra",
                             [](const detail::PendingCheckpoint& p) -> py::object {
                               if (!p.has_extra) return py::none();
                               return py::bytes(p.extra);
                             })
      .def("apply", [](detail::PendingCheckpoint& p) {
        py::gil_scoped_release nogil;
        p.apply();
      });
  // Reads and checks a checkpoint against the model; PendingCheckpoint.apply()
  // then writes it into the model.
  m.def("read_checkpoint", [](const std::string& path, const py::object& engine) {
    auto model = model_of(engine, "load_checkpoint");
    py::gil_scoped_release nogil;
    return detail::read_checkpoint(path, model);
  });
}

}  // namespace python
}  // namespace roundpipe
