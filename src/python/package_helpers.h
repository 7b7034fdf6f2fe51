// The package's own Python functions and classes that the binding calls.
// The extension imports no module of the package (which would make a cycle
// across the two languages): roundpipe/__init__.py hands them over once,
// through _C._register_helpers, before anything else of the package runs.
// All need the GIL.
#pragma once

#include "python/python_common.h"

namespace roundpipe {
namespace python {

struct PackageHelpers {
  py::object layer_adapter;   // roundpipe._layers.LayerAdapter(module, index)
  py::object flatten_node;    // roundpipe._values.flatten_node(obj)
  py::object unflatten_node;  // roundpipe._values.unflatten_node(type, children, context)
  py::object execute_plan;    // roundpipe.plan.ModelExecutePlan(fwd_plan, bwd_plan)
};

// The registered helpers; an error if the package has not registered them.
const PackageHelpers& package_helpers();

void bind_package_helpers(py::module_& m);

}  // namespace python
}  // namespace roundpipe
