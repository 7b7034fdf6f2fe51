// The plans a model's calls use when they are given none, and the layer
// costs they come from (the model's timer, and parameter bytes standing in
// for times until every layer is timed): auto_plan over the layer costs, with a stage per device at least, kept while a new one is not
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
#include <roundpipe/run_config.h>
#include <roundpipe/timer.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "engine/plan_searcher.h"

namespace roundpipe {

// The per-layer costs `timer` measured, once every layer has a forward time
// (recompute defaults to forward, backward to twice forward until
// measured); none before that. Their param_bytes are left empty.
std::optional<LayerCosts> measured_layer_costs(const ModelTimer& timer);

class Planner {
 public:
  // For calls on `num_devices` devices; `overlap`: fused calls overlap
  // (RoundPipeOptions::overlap_iterations), so their plan is searched;
  // `param_bytes`: [layer] the model's parameter bytes (none: plan() is
  // always given its costs).
  Planner(int64_t num_devices, bool overlap, std::vector<int64_t> param_bytes = {})
      : num_devices_(num_devices),
        overlap_(overlap),
        param_bytes_(std::move(param_bytes)),
        timer_(static_cast<int64_t>(param_bytes_.size())) {}

  int64_t num_layers() const { return static_cast<int64_t>(param_bytes_.size()); }
  // The per-layer times the calls record (call_timing.h).
  ModelTimer& timer() { return timer_; }
  const ModelTimer& timer() const { return timer_; }
  // Every layer has a forward time estimate.
  bool layers_timed() const;
  // Per-layer costs for planning: the timer's estimates once every layer
  // has a forward time (recompute defaults to forward, backward to twice
  // forward until measured); before that, parameter bytes stand in for time.
  LayerCosts layer_costs() const;

  // The plan a call of `kind` with `num_microbatch` microbatches runs: the
  // one in `cfg`, else the automatic one; validated for the model.
  ModelExecutePlan plan_for(const RunConfig& cfg, RunKind kind, int64_t num_microbatch);
  // A plan in the model's run config: checked for the calls it can serve
  // (forward_backward when its forward part stops before the last layer);
  // each call checks it again for its own kind.
  void check_model_plan(const ModelExecutePlan& plan) const;

  // A new automatic plan must be predicted this much faster than the current
  // one to replace it. With upper_threshold 1.1 this keeps plans put under
  // +-5% timing noise (auto_plan.h: 1.1 * 1.05 / 0.95 <= 1 / (1 - 0.2)).
  static constexpr double kPlanMinGain = 0.2;

  // The plan of a call of `kind` with `num_microbatch` microbatches over
  // `costs`; `timed`: the costs are measured times (not the parameter bytes
  // standing in for them), which the search needs.
  ModelExecutePlan plan(RunKind kind, int64_t num_microbatch, const LayerCosts& costs, bool timed);
  // The same over the model's own costs.
  ModelExecutePlan plan(RunKind kind, int64_t num_microbatch) {
    return plan(kind, num_microbatch, layer_costs(), layers_timed());
  }

  // Blocks until no search runs (the next plan() then adopts its result).
  void wait_for_search() const { searcher_.wait(); }

  // The longest a plan() call took on its caller's thread, in milliseconds.
  double longest_plan_ms() const { return longest_plan_ms_; }

 private:
  const int64_t num_devices_;
  const bool overlap_;
  const std::vector<int64_t> param_bytes_;
  ModelTimer timer_;
  std::array<ModelExecutePlan, 3> automatic_{};  // [RunKind]: empty until first used
  ModelExecutePlan adopted_;                     // the latest searched plan (empty: none yet)
  PlanSearcher searcher_;
  double longest_plan_ms_ = 0;
};

}  // namespace roundpipe
