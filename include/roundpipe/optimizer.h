// The optimizer side of RoundPipe (docs/guide.md, "3. A training loop"):
// optimizer copies, the optimizer thread, and the parameters() redirection.
//
// Thread-safety: set_sync_warmup_steps is thread-safe. OptimizerCtx acts on
// the calling thread only.
#pragma once

#include <cstdint>
#include <functional>

namespace roundpipe {

// The user's optimizer code, run on the optimizer thread by RoundPipe::step.
// It must only touch optimizer state, optimizer copies and their gradients.
using StepFn = std::function<void()>;

// Deprecated: RoundPipeOptions::sync_warmup_steps is the per-model setting.
// The default of that option for models built afterwards: their first `n`
// steps run synchronously before the one-step delay starts (default 0).
// Throws c10::ValueError for n < 0.
void set_sync_warmup_steps(int64_t n);
int64_t get_sync_warmup_steps();


// While an OptimizerCtx lives on a thread, RoundPipe::parameters() and
// named_parameters() called on that thread return the optimizer copies (as
// they do inside a step_fn), so
//   { OptimizerCtx ctx; opt = std::make_unique<Adam>(model.parameters()); }
// builds an optimizer over the optimizer copies. Nests.
class OptimizerCtx {
 public:
  OptimizerCtx();
  ~OptimizerCtx();
  OptimizerCtx(const OptimizerCtx&) = delete;
  OptimizerCtx& operator=(const OptimizerCtx&) = delete;

  // True on a thread inside an OptimizerCtx or running a step_fn.
  static bool active();
};

}  // namespace roundpipe
