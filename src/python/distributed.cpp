// roundpipe.distributed: process groups for data parallelism
// (include/roundpipe/distributed.h), driven from Python.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "python/python_common.h"
#include "roundpipe/distributed.h"

namespace roundpipe {
namespace python {

void bind_distributed(py::module_& m) {
  py::class_<ProcessGroup, std::shared_ptr<ProcessGroup>>(m, "ProcessGroup")
      .def_property_readonly("rank", &ProcessGroup::rank)
      .def_property_readonly("world_size", &ProcessGroup::world_size)
      .def_property_readonly("timeout_s",
                             [](const ProcessGroup& g) { return static_cast<double>(g.timeout().count()) / 1000.0; })
      .def("all_reduce_sum", &ProcessGroup::all_reduce_sum, py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &ProcessGroup::broadcast, py::call_guard<py::gil_scoped_release>())
      .def("barrier", &ProcessGroup::barrier, py::call_guard<py::gil_scoped_release>());
  m.def(
      "create_process_group",
      [](const std::string& init_method, int64_t rank, int64_t world_size, double timeout_s) {
        TORCH_CHECK_VALUE(timeout_s > 0, "init_process_group: timeout must be positive, got ", timeout_s, " s");
        ProcessGroupOptions options;
        options.init_method = init_method;
        options.rank = rank;
        options.world_size = world_size;
        options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
        return ProcessGroup::create(options);
      },
      py::call_guard<py::gil_scoped_release>());
  // A torch.distributed ProcessGroup (the c10d object DDP and FSDP take).
  m.def("wrap_process_group", [](const py::object& group, double timeout_s) {
    TORCH_CHECK_VALUE(timeout_s > 0, "RoundPipe: the process group's timeout must be positive, got ", timeout_s, " s");
    auto c10d_group = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
    py::gil_scoped_release nogil;
    return ProcessGroup::wrap(std::move(c10d_group),
                              std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0)));
  });
  m.def("distributed_available", &distributed_available);
}

}  // namespace python
}  // namespace roundpipe
