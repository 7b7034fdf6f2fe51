#include "python/package_helpers.h"

namespace roundpipe {
namespace python {
namespace {

// Never destroyed: the interpreter may be gone when static destructors run.
PackageHelpers* registered = nullptr;

}  // namespace

const PackageHelpers& package_helpers() {
  TORCH_CHECK(registered != nullptr,
              "roundpipe._C was imported without the roundpipe package: import roundpipe first");
  return *registered;
}

void bind_package_helpers(py::module_& m) {
  m.def(
      "_register_helpers",
      [](py::object layer_adapter, py::object flatten_node, py::object unflatten_node,
         py::object execute_plan) {
        // A second registration (importlib.reload) replaces the first, which
        // is kept: a thread may still be using it.
        registered = new PackageHelpers{std::move(layer_adapter), std::move(flatten_node),
                                        std::move(unflatten_node), std::move(execute_plan)};
      },
      py::arg("layer_adapter"), py::arg("flatten_node"), py::arg("unflatten_node"),
      py::arg("execute_plan"));
}

}  // namespace python
}  // namespace roundpipe
