// SharedPyObject and PythonError.
#include "python/python_common.h"

namespace roundpipe {
namespace python {
namespace {

bool interpreter_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

}  // namespace

SharedPyObject::SharedPyObject(py::object obj)
    : obj_(new py::object(std::move(obj)), [](py::object* p) {
        if (!interpreter_alive()) {
          p->release();  // the interpreter is gone: nothing to give back
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
  if (!interpreter_alive()) type = value = traceback = nullptr;
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
