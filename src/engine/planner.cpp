#include "engine/planner.h"

#include <algorithm>
#include <chrono>

namespace roundpipe {

std::optional<LayerCosts> measured_layer_costs(const ModelTimer& timer) {
  LayerCosts costs;
  for (int64_t l = 0; l < timer.num_layers(); ++l) {
    const c10::optional<double> fwd = timer.estimate(l, LayerAction::kForward);
    if (!fwd.has_value()) return std::nullopt;
    costs.fwd_ms.push_back(*fwd);
    costs.recompute_ms.push_back(timer.estimate(l, LayerAction::kRecompute).value_or(*fwd));
    costs.bwd_ms.push_back(timer.estimate(l, LayerAction::kBackward).value_or(2 * *fwd));
  }
  return costs;
}

bool Planner::layers_timed() const {
  for (int64_t l = 0; l < num_layers(); ++l) {
    if (!timer_.estimate(l, LayerAction::kForward).has_value()) return false;
  }
  return true;
}

LayerCosts Planner::layer_costs() const {
  std::optional<LayerCosts> measured = measured_layer_costs(timer_);
  if (measured.has_value()) {
    measured->param_bytes = param_bytes_;
    return *measured;
  }
  LayerCosts costs;
  costs.param_bytes = param_bytes_;
  for (int64_t l = 0; l < num_layers(); ++l) {
    const double size = static_cast<double>(param_bytes_[l]);
    costs.fwd_ms.push_back(size);
    costs.recompute_ms.push_back(size);
    costs.bwd_ms.push_back(2 * size);
  }
  return costs;
}

ModelExecutePlan Planner::plan_for(const RunConfig& cfg, RunKind kind, int64_t num_microbatch) {
  ModelExecutePlan plan = cfg.execute_plan() ? *cfg.execute_plan() : this->plan(kind, num_microbatch);
  plan.validate(num_layers(), kind);
  return plan;
}

void Planner::check_model_plan(const ModelExecutePlan& plan) const {
  const bool fused = !plan.fwd_plan.empty() ? plan.fwd_plan.back().end < num_layers() : !plan.bwd_plan.empty();
  plan.validate(num_layers(), fused ? RunKind::kFused : plan.bwd_plan.empty() ? RunKind::kInfer : RunKind::kTrain);
}

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
