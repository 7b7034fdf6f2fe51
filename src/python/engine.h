// The engine object the Python package's RoundPipe holds (roundpipe._C.Engine,
// module.cpp), for the bindings that take a model (checkpoints).
#pragma once

#include <pybind11/pybind11.h>

#include "roundpipe/model.h"

namespace roundpipe {
namespace python {

// The model behind `engine` (a roundpipe._C.Engine); TypeError for anything
// else, ValueError once it was closed. `who` names the caller in errors.
RoundPipe& engine_model(const pybind11::handle& engine, const char* who);

}  // namespace python
}  // namespace roundpipe
