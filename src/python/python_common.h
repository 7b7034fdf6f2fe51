// Shared by the Python binding: pybind11 with libtorch's tensor casters, and
// holders that let C++ worker threads keep Python objects.
//
// Threads: the engine calls into Python from device workers and the optimizer
// thread. Every call into Python takes the GIL around that call only; every
// blocking binding releases it (so those threads can take it).
#pragma once

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>

#include "util/contextual_error.h"
#include "util/interrupt.h"

namespace roundpipe {
namespace python {

namespace py = pybind11;

// A Python object that C++ threads may copy and drop without holding the GIL
// (the last owner takes the GIL to release it). Using get() needs the GIL.
class SharedPyObject {
 public:
  SharedPyObject() = default;
  explicit SharedPyObject(py::object obj);  // GIL held
  const py::object& get() const { return *obj_; }
  explicit operator bool() const { return obj_ != nullptr; }

 private:
  std::shared_ptr<py::object> obj_;
};

// A Python exception crossing the engine: it keeps its class (the binding and
// torch's own handlers restore it as it was raised) and takes the engine's
// context (model, stage, layer, microbatch, device) into its message.
class PythonError : public ::python_error, public ContextualError {
 public:
  // Takes the Python error currently set (GIL held).
  static PythonError fetch();
  // Once the interpreter is shutting down, leaks the exception's objects:
  // python_error's destructor would take the GIL, and a non-Python thread
  // that asks for it then is ended on the spot.
  ~PythonError() override;
  void add_context(const std::string& context) override;
};

// Engine threads enter Python only through this gate (a Python call, the
// release of a Python object). At exit, close_engine_threads_gate() waits
// until no engine thread is inside, then shuts it: later a Python call fails
// and an object is leaked, since an engine thread that asked for the GIL
// while the interpreter finalizes would be ended on the spot. Other threads
// always pass, uncounted.
class EngineThreadGate {
 public:
  EngineThreadGate();  // enters, unless this is an engine thread and the gate is shut
  ~EngineThreadGate();
  EngineThreadGate(const EngineThreadGate&) = delete;
  EngineThreadGate& operator=(const EngineThreadGate&) = delete;
  bool entered() const { return entered_; }

 private:
  bool entered_ = true;
  bool counted_ = false;
};

// Waits (GIL released) until no destruction is pending and no engine thread
// is inside the gate, then shuts the gate. For the interpreter's exit.
void close_engine_threads_gate();

// Runs a Python call site: GIL taken, pybind11's error turned into
// PythonError.
template <typename Fn>
auto call_python(Fn&& fn) -> decltype(fn()) {
  EngineThreadGate gate;  // declared first: the GIL is given back before it is left
  TORCH_CHECK(gate.entered(), "the Python interpreter is exiting: engine threads no longer run Python code");
  py::gil_scoped_acquire gil;
  try {
    return fn();
  } catch (py::error_already_set& e) {
    e.restore();
    throw PythonError::fetch();
  }
}

// The poll of an InterruptScope around a blocking call of the main thread:
// runs Python's pending signal handlers (GIL taken briefly) and returns the
// exception one raised (KeyboardInterrupt on Ctrl-C), else nullptr.
std::exception_ptr poll_python_signals();

// The user's callable's name for messages ("my_loss", "<lambda>").
std::string callable_name(const py::handle& fn);

}  // namespace python
}  // namespace roundpipe
