// What the engine's own files reach behind RoundPipe's public interface: its
// state (checkpoints) and a model over layers that a language binding adapted
// itself (src/python/py_layer.h).
//
// Thread-compatible, as RoundPipe.
#pragma once

#include <memory>
#include <vector>

#include "engine/layer_handle.h"
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
