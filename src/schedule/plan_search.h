// Plans chosen by simulating them: a local search over the stage boundaries
// of a fused plan, scored by the simulator (simulator.h) running the engine's
// lifecycle, so that the plan fits the schedule rather than only balancing
// stage times.
//
// Why. With iterations overlapping and jobs given devices by predicted
// start, what idles devices is not the longest stage but stages shorter than
// the stage feeding them, and the chain running out of ready jobs; which
// plans avoid both depends on the stage times in coarse units (whole
// layers), so it is found, not derived (docs/design/engine.md, B4).
//
// How. Two starts: the balanced plan given (auto_plan's), and the same
// budget filled greedily along the chain (each stage of a pass as long as
// the budget allows, in the order the pass runs, a shorter remainder merged
// into the pass's last stage: stage times then do not fall along the
// chain). From each, steepest descent: every neighbour (one boundary moved
// by one layer, two neighbouring stages merged, a stage split in halves) is
// simulated and the best strictly better one taken, until none is better or
// the simulation budget is spent. The result is the best plan seen; equal
// inputs give equal plans.
//
// Thread-safety: pure function of its arguments (PlanSearchOptions::stop
// aside).
#pragma once

#include <roundpipe/auto_plan.h>
#include <roundpipe/plan.h>

#include <atomic>
#include <cstdint>

namespace roundpipe {

struct PlanSearchOptions {
  // Devices D >= 1 and microbatches M >= 1 of the calls the plan is for.
  int64_t num_devices = 1;
  int64_t num_microbatch = 1;
  // Iterations overlap (the engine's default): the score is the steady
  // state's time per iteration (IterationOverlap::kAfterLosses); otherwise
  // one iteration alone.
  bool overlap = true;
  // Stages in all, at least (capped at what the layers allow), and the
  // parameter-memory limit of AutoPlanOptions (0 = unlimited).
  int64_t min_stages = 1;
  int64_t model_memory_limit_bytes = 0;
  // Bandwidth of each device's link per direction, GB/s (> 0): what
  // parameter uploads, gradient downloads and hand-offs (the costs'
  // activation_bytes) cost in the score. 25: PCIe 4.0 x16, a consumer
  // GPU's link.
  double link_gbps = 25.0;
  // Simulations the search may run, >= 1.
  int64_t max_simulations = 400;
  // Set from another thread to end the search at its next simulation (the
  // best plan so far is returned). Null: never.
  const std::atomic<bool>* stop = nullptr;
};

struct PlanSearchResult {
  ModelExecutePlan plan;
  double start_ms = 0;  // the given plan's simulated time per iteration
  double best_ms = 0;   // the result's
  int64_t simulations = 0;
};

// Searches fused plans for a model with `costs`, starting from `start` (a
// valid fused plan, e.g. auto_plan's). Never returns a plan simulated slower
// than `start`. Throws c10::ValueError when
// the costs or the plan are not valid or an option is out of range.
PlanSearchResult search_fused_plan(const LayerCosts& costs, const ModelExecutePlan& start,
                                   const PlanSearchOptions& options);

// The engine's automatic plan for fused calls whose iterations overlap on
// `num_devices` devices with `num_microbatch` microbatches: search_fused_plan
// from `balanced` (auto_plan's) with a stage per device at least and the
// other options at their defaults (`stop` as PlanSearchOptions::stop). The
// engine, roundpipe-sim and B4 plan with it.
PlanSearchResult search_overlapped_plan(const LayerCosts& costs, const ModelExecutePlan& balanced,
                                        int64_t num_devices, int64_t num_microbatch,
                                        const std::atomic<bool>* stop = nullptr);

}  // namespace roundpipe
