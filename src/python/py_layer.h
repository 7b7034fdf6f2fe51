// The engine's LayerHandle over a user's Python nn.Module.
//
// Each device gets a structural replica (a deep copy made without the
// tensors' data, see roundpipe/_layers.py) whose parameters and buffers are
// pointed at the device tensors of the job; replicas of one layer run on
// several devices at once. The GIL is taken only to create a replica, call its
// forward and read its buffers back.
#pragma once

#include <atomic>
#include <memory>

#include "engine/engine_access.h"
#include "python/python_common.h"

namespace roundpipe {
namespace python {

class PyLayer;

// `module`: the layer; `index`: its position, for messages. GIL held.
// ValueError for tensors off the CPU.
std::shared_ptr<PyLayer> make_py_layer(const py::object& module, int64_t index);

class PyLayer : public LayerHandle {
 public:
  // Reads the module's training flag again (GIL held): users may switch
  // single submodules between calls.
  virtual void refresh_mode() = 0;
};

}  // namespace python
}  // namespace roundpipe
