// Native (C++) modules in the Python package: a libtorch module that Python
// holds as one layer (roundpipe.presets wraps it in an nn.Module whose
// parameters are the module's own tensors). The engine runs such a layer
// directly, without the GIL.
#pragma once

#include <torch/nn/modules/container/any.h>

#include <memory>

#include "engine/layer.h"
#include "python/python_common.h"

namespace roundpipe {
namespace python {

struct NativeModule {
  torch::nn::AnyModule any;
};

// The engine layer of Python layer `module` at `index` when it wraps a
// NativeModule (attribute `_roundpipe_native`), else nullptr.
std::shared_ptr<Layer> native_layer(const py::handle& module, int64_t index);

// roundpipe._C.NativeModule, DecoderConfig and the preset builders.
void bind_presets(py::module_& m);

}  // namespace python
}  // namespace roundpipe
