// SharedPyObject, PythonError and the engine threads' gate into Python.
#include "python/python_common.h"

#include <condition_variable>
#include <mutex>

#include "engine/engine_access.h"
#include "util/worker_thread.h"

namespace roundpipe {
namespace python {
namespace {

std::mutex gate_mu;
std::condition_variable gate_empty;
int threads_inside = 0;  // engine threads inside the gate, guarded by gate_mu
bool gate_shut = false;  // guarded by gate_mu

bool interpreter_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

}  // namespace

EngineThreadGate::EngineThreadGate() {
  if (!WorkerThread::on_a_worker_thread()) return;
  std::lock_guard<std::mutex> lock(gate_mu);
  entered_ = !gate_shut;
  counted_ = entered_;
  if (counted_) ++threads_inside;
}

EngineThreadGate::~EngineThreadGate() {
  if (!counted_) return;
  std::lock_guard<std::mutex> lock(gate_mu);
  if (--threads_inside == 0) gate_empty.notify_all();
}

void close_engine_threads_gate() {
  for (;;) {
    // A destruction may run Python (a step_fn it waits for); a thread inside
    // may hand on a destruction: wait until both have run out at once.
    wait_for_pending_destructions();
    std::unique_lock<std::mutex> lock(gate_mu);
    gate_empty.wait(lock, [] { return threads_inside == 0; });
    if (unfinished_destructions() == 0) {
      gate_shut = true;
      return;
    }
  }
}

SharedPyObject::SharedPyObject(py::object obj)
    : obj_(new py::object(std::move(obj)), [](py::object* p) {
        EngineThreadGate gate;
        if (!gate.entered() || !interpreter_alive()) {
          p->release();  // the interpreter is gone or going: nothing to give back
          delete p;
          return;
        }
        py::gil_scoped_acquire gil;
        delete p;
      }) {}

std::exception_ptr poll_python_signals() {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return nullptr;
  return std::make_exception_ptr(PythonError::fetch());
}

PythonError PythonError::fetch() {
  PythonError error;
  error.persist();
  if (error.type != nullptr) {
    // Normalized, so `value` is the exception instance whose message we extend.
    py::gil_scoped_acquire gil;
    PyErr_NormalizeException(&error.type, &error.value, &error.traceback);
    if (error.traceback != nullptr && error.value != nullptr) {
      PyException_SetTraceback(error.value, error.traceback);
    }
  }
  return error;
}

PythonError::~PythonError() {
  EngineThreadGate gate;
  if (!gate.entered() || !interpreter_alive()) type = value = traceback = nullptr;
}

void PythonError::add_context(const std::string& context) {
  message += "\n" + context;
  if (value == nullptr) return;
  py::gil_scoped_acquire gil;
  PyObject *saved_type = nullptr, *saved_value = nullptr, *saved_tb = nullptr;
  PyErr_Fetch(&saved_type, &saved_value, &saved_tb);  // keep any error being handled
  try {
    py::handle exc(value);
    py::object args = exc.attr("args");
    if (py::isinstance<py::tuple>(args) && py::len(args) >= 1 && py::isinstance<py::str>(args[py::int_(0)])) {
      // The message is args[0]: extend it in place, so str(exc) shows it.
      py::list items(args);
      items[0] = py::str(items[0]) + py::str("\n" + context);
      exc.attr("args") = py::tuple(items);
    } else if (py::hasattr(exc, "add_note")) {
      exc.attr("add_note")(context);
    }
  } catch (py::error_already_set&) {
    // An exception class whose args cannot be set keeps its message.
  }
  PyErr_Restore(saved_type, saved_value, saved_tb);
}

std::string callable_name(const py::handle& fn) {
  py::gil_scoped_acquire gil;
  for (const char* attr : {"__qualname__", "__name__"}) {
    if (py::hasattr(fn, attr)) return py::str(fn.attr(attr));
  }
  return py::str(py::type::handle_of(fn).attr("__name__"));
}

}  // namespace python
}  // namespace roundpipe
