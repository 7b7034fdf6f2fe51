// The calling thread's current layer run, as seen by the recompute hooks of
// roundpipe/recompute.h.
#pragma once

#include <ATen/core/ivalue.h>

#include <vector>

namespace roundpipe {

enum class RunMode {
  kPlain,      // no backward follows, or the fused stage: saving is a no-op
  kSaving,     // a forward stage whose layers will be recomputed
  kRecompute,  // recomputing: the saved data is available
};

struct LayerRunState {
  RunMode mode = RunMode::kPlain;
  bool saved = false;                   // save_for_recompute called in this run
  c10::optional<std::vector<c10::IValue>> data;  // saved data (kSaving: out, kRecompute: in)
};

// Sets the thread's current layer run for the scope.
class LayerRunScope {
 public:
  explicit LayerRunScope(LayerRunState* state);
  ~LayerRunScope();
  LayerRunScope(const LayerRunScope&) = delete;
  LayerRunScope& operator=(const LayerRunScope&) = delete;

 private:
  LayerRunState* previous_;
};

}  // namespace roundpipe
