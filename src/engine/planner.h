// The plans a model's calls use when they are given none: auto_plan over the
// layer costs, with a stage per device at least, kept while a new one is not
// materially better (hysteresis); for fused calls whose iterations overlap on
// two devices or more, once every layer is timed, the plan the search finds
// from it (plan_search.h), searched on a background thread (PlanSearcher)
// and adopted by the first call after it is done. No call waits for a search.
//
// Thread-safety: the model's user thread only (the search's own thread is
// PlanSearcher's).
#pragma once

#include <roundpipe/auto_plan.h>
#include <roundpipe/plan.h>

#include <array>
#include <cstdint>

#include "engine/plan_searcher.h"

namespace roundpipe {

class Planner {
 public:
  // For calls on `num_devices` devices; `overlap`: fused calls overlap
  // (RoundPipeOptions::overlap_iterations), so their plan is searched.
  Planner(int64_t num_devices, bool overlap) : num_devices_(num_devices), overlap_(overlap) {}

  // A new automatic plan must be predicted this much faster than the current
  // one to replace it. With upper_threshold 1.1 this keeps plans put under
  // +-5% timing noise (auto_plan.h: 1.1 * 1.05 / 0.95 <= 1 / (1 - 0.2)).
  static constexpr double kPlanMinGain = 0.2;

  // The plan of a call of `kind` with `num_microbatch` microbatches over
  // `costs`; `timed`: the costs are measured times (not the parameter bytes
  // standing in for them), which the search needs.
  ModelExecutePlan plan(RunKind kind, int64_t num_microbatch, const LayerCosts& costs, bool timed);

  // Blocks until no search runs (the next plan() then adopts its result).
  void wait_for_search() const { searcher_.wait(); }

  // The longest a plan() call took on its caller's thread, in milliseconds.
  double longest_plan_ms() const { return longest_plan_ms_; }

 private:
  const int64_t num_devices_;
  const bool overlap_;
  std::array<ModelExecutePlan, 3> automatic_{};  // [RunKind]: empty until first used
  ModelExecutePlan adopted_;                     // the latest searched plan (empty: none yet)
  PlanSearcher searcher_;
  double longest_plan_ms_ = 0;
};

}  // namespace roundpipe
