// Python values <-> the engine's c10::IValue trees.
//
//  Python                        IValue
//  torch.Tensor                  Tensor
//  None, bool, int, float, str   None, Bool, Int, Double, String
//  tuple, list                   Tuple, List[Any]
//  dict with str keys            Dict[str, Any]
//  registered pytree node        Tuple(node marker, children...) (namedtuple,
//   (torch.utils._pytree)          OrderedDict, other dicts, user classes)
//  roundpipe.MicrobatchValues    MicrobatchValues object (chaining)
//  anything else                 an opaque leaf (Capsule holding the object)
//
// Tuples, lists and dicts are rebuilt as such (exact types: subclasses go
// through the pytree registry), so a layer gets back what it was given.
// All functions need the GIL.
#pragma once

#include <ATen/core/ivalue.h>

#include <vector>

#include "python/python_common.h"
#include "roundpipe/microbatch.h"

namespace roundpipe {
namespace python {

c10::IValue to_ivalue(const py::handle& obj);
py::object to_python(const c10::IValue& value);

// Positional args and keyword args of a call.
std::vector<c10::IValue> args_to_ivalues(const py::handle& args);
Kwargs kwargs_to_ivalues(const py::handle& kwargs);
py::tuple args_to_python(const std::vector<c10::IValue>& args);
py::dict kwargs_to_python(const Kwargs& kwargs);

// Python's view of a MicrobatchValues (merge_output=False outputs).
struct PyMicrobatchValues {
  c10::IValue value;  // the MicrobatchValues object
};

void bind_values(py::module_& m);

}  // namespace python
}  // namespace roundpipe
