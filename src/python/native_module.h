// Native (C++) modules in the Python package: a libtorch module that Python
// holds as one layer (roundpipe.presets wraps it in an nn.Module whose
// parameters are the module's own tensors). The engine runs such a layer
// directly, without the GIL.
#pragma once

#include <torch/nn/modules/container/any.h>

#include <memory>

#include "engine/engine_access.h"
#include "python/python_common.h"

namespace roundpipe {
namespace python {

struct NativeModule {
  torch::nn::AnyModule any;
};

// The C++ module of Python layer `module` when it wraps a NativeModule
// (attribute `_roundpipe_native`), else none. GIL held. Make its engine layer
// (make_module_layer) without the GIL: that takes the generator lock, which
// device workers hold while they wait for the GIL.
c10::optional<torch::nn::AnyModule> native_module_of(const py::handle& module);

// roundpipe._C.NativeModule, DecoderConfig and the preset builders.
void bind_presets(py::module_& m);

}  // namespace python
}  // namespace roundpipe
