// Per-model and per-call run options (docs/guide.md, "4. Run options").
//
// Every field is optional: unset means "inherit" (per-call config > model-level
// config > built-in default). Setters chain:
//   RunConfig().num_microbatch(4).recompute_grain(RecomputeGrain::kLayer)
// Thread-safety: plain value.
#pragma once

#include <roundpipe/microbatch.h>
#include <roundpipe/plan.h>

#include <c10/core/Device.h>
#include <c10/util/Optional.h>

namespace roundpipe {

enum class RecomputeGrain {
  kStage,  // recompute a whole backward stage, then backpropagate it at once
  kLayer,  // recompute and backpropagate one layer at a time: lower peak memory
};

#define ROUNDPIPE_OPTION(T, name)                   \
 public:                                            \
  RunConfig& name(T value) {                        \
    name##_ = std::move(value);                     \
    return *this;                                   \
  }                                                 \
  const c10::optional<T>& name() const { return name##_; } \
                                                    \
 private:                                           \
  c10::optional<T> name##_;

class RunConfig {
  // Microbatches per call; >= 1. Default: number of devices + 1. Reduced to the
  // batch size (with a warning) when the batch is smaller.
  ROUNDPIPE_OPTION(int64_t, num_microbatch)
  // Default kStage.
  ROUNDPIPE_OPTION(RecomputeGrain, recompute_grain)
  // Where merged outputs are returned. Default: CPU.
  ROUNDPIPE_OPTION(c10::Device, output_device)
  // Replay random streams in recomputation. Default true.
  ROUNDPIPE_OPTION(bool, preserve_rng_state)
  // Build autograd history for forward(). Default: GradMode::is_enabled().
  ROUNDPIPE_OPTION(bool, requires_grad)
  ROUNDPIPE_OPTION(InputSplit, split_input)
  ROUNDPIPE_OPTION(LabelSplit, split_label)
  ROUNDPIPE_OPTION(OutputMerge, merge_output)
  // Default: a plan derived from the model (see default_plan).
  ROUNDPIPE_OPTION(ModelExecutePlan, execute_plan)

 public:
  // Fields set here win; unset fields come from `base`.
  RunConfig merged_over(const RunConfig& base) const;
};

#undef ROUNDPIPE_OPTION

}  // namespace roundpipe
