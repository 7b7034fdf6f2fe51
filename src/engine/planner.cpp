#include "engine/planner.h"

#include <algorithm>
#include <chrono>

namespace roundpipe {

ModelExecutePlan Planner::plan(RunKind kind, int64_t num_microbatch, const LayerCosts& costs, bool timed) {
  const auto start = std::chrono::steady_clock::now();
  AutoPlanOptions options;
  options.set_run_kind(kind).set_min_stages(num_devices_).set_upper_threshold(1.1);
  const ModelExecutePlan candidate = auto_plan({costs}, options).front();
  ModelExecutePlan& current = automatic_[static_cast<size_t>(kind)];
  current = choose_plan(current, candidate, costs, kind, kPlanMinGain);
  ModelExecutePlan out = current;
  if (kind == RunKind::kFused && overlap_ && num_devices_ >= 2 && timed) {
    // Searched again only when the balanced plan or M changes; meanwhile
    // the latest searched plan (any valid fused plan of the model) serves.
    if (c10::optional<ModelExecutePlan> found = searcher_.find(costs, current, num_devices_, num_microbatch)) {
      adopted_ = std::move(*found);
    }
    if (!adopted_.fwd_plan.empty() || !adopted_.bwd_plan.empty()) out = adopted_;
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  longest_plan_ms_ = std::max(longest_plan_ms_, ms);
  return out;
}

}  // namespace roundpipe
