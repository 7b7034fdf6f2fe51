// The automatic execution planner (ModelExecutePlan.auto in Python; docs/trace.md,
// "2. Execution plans"): groups each model's layers into stages from per-layer
// time and size estimates.
//
// Stage time. A forward stage costs the sum of its layers' fwd_ms; the fused
// stage of a fused plan (bwd_plan[0]) costs fwd_ms + bwd_ms; every other
// backward stage costs recompute_ms + bwd_ms. A plan's worst stage time is
// the largest over all its stages (the pipeline's bottleneck).
//
// How auto_plan chooses. Let T* be the smallest worst stage time any set of
// valid plans can reach under the memory limit. Every stage of every model
// may then take up to the shared budget upper_threshold * T*; each model uses
// the FEWEST stages that stay within that budget (each stage boundary is a
// hand-over between devices, so fewer stages means fewer transfers), and no
// fewer than min_stages where the model has enough layers: per pass for
// kInfer and kTrain (each pass is its own call), in all for kFused (its one
// call hands every stage, fused stage included, round-robin to the devices;
// stages beyond the fewest go to the pass where they lower the worst stage
// time most). Stages of about equal time keep the devices busiest: with
// M = D + 1 microbatches, a stage much shorter than its neighbours leaves its
// device waiting for input. With its
// stage counts fixed, each pass is split so that its worst stage time is the
// smallest possible (exact, not heuristic), with stage boundaries as close to
// an even split of the pass's time as that allows. The forward pass is
// fwd_plan (plus the fused stage in a fused plan); the backward pass is
// bwd_plan. A fused plan also chooses where its fused stage begins: fewest
// stages first, then the smallest worst stage time, then the larger fused
// stage (its layers need no recomputation). Deterministic: equal inputs give
// equal plans.
//
// Models are planned jointly: chained models run one after another over the
// same devices, so T* and the budget are shared; a model with light layers
// gets fewer, longer stages rather than many short ones.
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <roundpipe/plan.h>

#include <cstdint>
#include <vector>

namespace roundpipe {

// Per-layer cost estimates of one model; every vector has one entry per layer.
struct LayerCosts {
  // Milliseconds per microbatch. When timings are unknown, pass estimates
  // proportional to parameter bytes. Finite and >= 0.
  std::vector<double> fwd_ms;
  std::vector<double> recompute_ms;
  std::vector<double> bwd_ms;
  // Parameter bytes of each layer, >= 0.
  std::vector<int64_t> param_bytes;
  // Bytes a stage boundary after this layer hands on, per microbatch, >= 0.
  // May be left empty (all 0). Breaks ties only: among equally good
  // boundaries the cheaper hand-over wins.
  std::vector<int64_t> activation_bytes;

  int64_t num_layers() const { return static_cast<int64_t>(fwd_ms.size()); }
};

struct AutoPlanOptions {
  RunKind run_kind = RunKind::kTrain;
  // Stages per pass (kInfer, kTrain) or per fused call in all (kFused), at
  // least; capped at what the layers allow (n per pass, 2n - 1 fused).
  // Usually the number of devices, so that each device gets work. >= 1.
  int64_t min_stages = 1;
  // How much slower than the best reachable bottleneck a plan may be in
  // exchange for fewer stages. >= 1; 1 asks for the best bottleneck.
  double upper_threshold = 1.1;
  // Each stage's parameters and gradients (2 * its param_bytes) must fit in
  // half of this, whatever the run kind. 0 = unlimited.
  int64_t model_memory_limit_bytes = 0;

  AutoPlanOptions& set_run_kind(RunKind v) { run_kind = v; return *this; }
  AutoPlanOptions& set_min_stages(int64_t v) { min_stages = v; return *this; }
  AutoPlanOptions& set_upper_threshold(double v) { upper_threshold = v; return *this; }
  AutoPlanOptions& set_model_memory_limit_bytes(int64_t v) {
    model_memory_limit_bytes = v;
    return *this;
  }
};

// One plan per model, in order, each valid for options.run_kind (see the top
// of this file for how plans are chosen). Throws c10::ValueError when there is
// no model, a model has no layer, the cost vectors of a model differ in
// length, a cost is negative or not finite, a model's times add up to more
// than the largest double, an option is out of range, or a single layer
// alone exceeds the memory limit.
std::vector<ModelExecutePlan> auto_plan(const std::vector<LayerCosts>& models,
                                        const AutoPlanOptions& options);

// Hysteresis, so that plans (and with them memory use and speed) stay put
// while timings only jitter: returns `candidate` if its worst stage time is
// below (1 - min_gain) times that of `current`, both predicted from `costs`;
// otherwise returns `current`. An empty `current` (no plan yet) yields
// `candidate`.
//
// Guarantee: if `current` and `candidate` come from auto_plan with the same
// options (upper_threshold u) and every timing moved by at most a factor
// 1 +- e in between, `current` is kept whenever
//   u * (1 + e) / (1 - e) <= 1 / (1 - min_gain).
// E.g. u = 1 with min_gain = 0.05 absorbs +-2.5% noise, and u = 1.1 with +-5%
// noise needs min_gain >= 0.18. Outside that bound noise can (rarely) flip a
// plan whose stage count was chosen at the edge of the budget.
//
// Throws c10::ValueError when min_gain is not in [0, 1) or a plan is not
// valid for `costs` and `kind`.
ModelExecutePlan choose_plan(const ModelExecutePlan& current, const ModelExecutePlan& candidate,
                             const LayerCosts& costs, RunKind kind, double min_gain = 0.05);

// The same rule for models planned jointly: their worst stage time is the
// largest over all of them, and all plans switch together or none does (the
// guarantee above holds for the models together, not for each one alone, as
// they share one budget). The three vectors hold one entry per model; an
// empty `current` yields `candidate`. Throws c10::ValueError as the
// single-model form does, or when the vectors' lengths differ.
std::vector<ModelExecutePlan> choose_plan(const std::vector<ModelExecutePlan>& current,
                                          const std::vector<ModelExecutePlan>& candidate,
                                          const std::vector<LayerCosts>& costs, RunKind kind,
                                          double min_gain = 0.05);

// Predicted time of the plan's worst stage under `costs`, in milliseconds (see
// the top of this file). For kInfer only fwd_plan counts. Throws
// c10::ValueError when the costs or the plan are not valid.
double worst_stage_ms(const ModelExecutePlan& plan, const LayerCosts& costs, RunKind kind);
// The largest worst_stage_ms over jointly planned models (one entry each).
double worst_stage_ms(const std::vector<ModelExecutePlan>& plans,
                      const std::vector<LayerCosts>& costs, RunKind kind);

}  // namespace roundpipe
