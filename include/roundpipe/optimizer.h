// The optimizer side of RoundPipe (SPEC 4.2, 4.3): optimizer copies, the
// optimizer thread, and the parameters() redirection.
//
// Thread-safety: set_sync_warmup_steps and set_overlap_iterations are thread-safe. OptimizerCtx acts on
// the calling thread only.
#pragma once

#include <cstdint>
#include <functional>

namespace roundpipe {

// The user's optimizer code, run on the optimizer thread by RoundPipe::step.
// It must only touch optimizer state, optimizer copies and their gradients.
using StepFn = std::function<void()>;

// The first `n` steps of every model run synchronously before the one-step
// delay starts (default 0): a known remedy for early instability of delayed
// updates. Throws c10::ValueError for n < 0.
void set_sync_warmup_steps(int64_t n);
int64_t get_sync_warmup_steps();

// Iteration overlap (default off). When on, forward_backward of a model
// without buffers returns once its losses are known, with its backward
// stages still running, so that the next iteration's stages reach the
// devices while they finish: the pipeline's drain and fill overlap. The
// next step takes the call's gradients when they are complete (on the
// optimizer thread), and a delayed step writes each layer only after the
// call's last upload of it. Results are bitwise those of overlap off.
// What changes is where a failure of those backward stages is raised: by
// the next call that waits for them (forward_backward, step, synchronize,
// forward, checkpoints, load_state_dict), like an asynchronous step_fn's
// error; the failed call's gradients are never applied. Calls whose inputs
// require grad, models with buffers and synchronous steps do not overlap.
void set_overlap_iterations(bool on);
bool get_overlap_iterations();

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
