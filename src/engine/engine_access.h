// The one header through which language bindings (src/python) reach behind
// RoundPipe's public interface: a model over layers the binding adapted
// itself (LayerHandle, src/python/py_layer.h), where engines may be
// destroyed (lifetime.h), the optimizer thread of the model that stepped last
// (optimizer_thread.h: GradScaler), and checkpoints whose optimizer state the binding
// keeps itself (checkpoint_internal.h). scripts/check-includes holds the
// bindings to it.
//
// Thread-compatible, as RoundPipe.
#pragma once

#include <memory>
#include <vector>

#include "engine/checkpoint_internal.h"
#include "engine/layer_handle.h"
#include "engine/lifetime.h"
#include "engine/optimizer_thread.h"
#include "roundpipe/model.h"

namespace roundpipe {
namespace detail {

struct EngineAccess {
  static const std::shared_ptr<RoundPipe::Impl>& impl(RoundPipe& model) { return model.impl_; }
  // Wraps already-adapted layers; none may be null. Errors as RoundPipe's
  // constructor's (c10::ValueError / c10::TypeError naming the model).
  static RoundPipe from_layers(std::vector<std::shared_ptr<LayerHandle>> layers,
                               RoundPipeOptions options);
};

}  // namespace detail
}  // namespace roundpipe
