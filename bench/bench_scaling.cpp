// B4: scaling, simulated. The real scheduler and the real auto-planner on
// modeled devices with a Qwen3-1.7B-on-RTX-4090 cost model (one microbatch
// of ~26k tokens), for D = 1, 2, 4, 8 devices and M = D + 1 microbatches,
// asynchronous steps with iterations overlapping as the engine runs them by
// default (IterationOverlap::kAfterLosses), jobs given devices by predicted
// start as the engine gives them; against GPipe and 1F1B over the same
// layers, split into D balanced stages, computed by the same simulator.
// Also the engine's planner (engine/planner.h) over the same costs, called
// once per simulated iteration as calls call it: the longest time a call
// spent on plan selection (the search runs on the planner's own thread).
//
// The plan is the one the engine's automatic planner picks for D = 8 with
// iterations overlapping (auto_plan, then search_overlapped_plan) and is used for
// every D, so that speedups compare the same work.
#include <roundpipe/auto_plan.h>

#include <chrono>
#include <cstdio>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "engine/planner.h"
#include "schedule/plan_search.h"
#include "schedule/simulator.h"

using namespace roundpipe;

namespace {

constexpr double kLinkGbps = 25.0;  // per direction per device
constexpr int64_t kMB = 1000000;
constexpr double kInfinity = std::numeric_limits<double>::infinity();

// Layer 0: the embedding; 1..28: decoder blocks; 29: the final norm and the
// LM head, whose weight is tied to the embedding (each stage holding one of
// them uploads the 622 MB matrix).
LayerCosts Qwen3On4090() {
  LayerCosts c;
  auto layer = [&](double fwd, double recompute, double bwd, int64_t params) {
    c.fwd_ms.push_back(fwd);
    c.recompute_ms.push_back(recompute);
    c.bwd_ms.push_back(bwd);
    c.param_bytes.push_back(params);
    c.activation_bytes.push_back(107 * kMB);  // hidden states of one microbatch, fp16
  };
  layer(0.8, 0.8, 1.6, 622 * kMB);
  for (int i = 0; i < 28; ++i) layer(16, 16, 32, 100 * kMB);
  layer(48, 48, 96, 622 * kMB);
  return c;
}

std::string Stages(const ModelExecutePlan& p) {
  return std::to_string(p.fwd_plan.size()) + "+1+" + std::to_string(p.bwd_plan.size() - 1);
}

}  // namespace

int main() {
  const LayerCosts costs = Qwen3On4090();
  const ModelExecutePlan balanced =
      auto_plan({costs}, AutoPlanOptions().set_run_kind(RunKind::kFused).set_min_stages(8)).at(0);
  const auto search_start = std::chrono::steady_clock::now();
  const PlanSearchResult searched = search_overlapped_plan(costs, balanced, 8, 9);
  const double search_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - search_start).count();
  const ModelExecutePlan& plan = searched.plan;
  // The planner as calls use it, one call per 20 ms, until the searched plan
  // is adopted (or three times the search's time has passed).
  Planner planner(8, /*overlap=*/true);
  const ModelExecutePlan first = planner.plan(RunKind::kFused, 9, costs, /*timed=*/true);
  int64_t planner_calls = 1;
  const auto planner_start = std::chrono::steady_clock::now();
  bool adopted = false;
  while (!adopted && std::chrono::duration<double>(std::chrono::steady_clock::now() - planner_start).count() <
                         3 * search_s + 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    adopted = !(planner.plan(RunKind::kFused, 9, costs, /*timed=*/true) == first);
    ++planner_calls;
  }
  const double plan_ms_on_caller = planner.longest_plan_ms();
  planner.wait_for_search();
  const bool search_changes_plan = !(planner.plan(RunKind::kFused, 9, costs, /*timed=*/true) == first);
  std::printf(
      "B4 scaling (simulated): Qwen3-1.7B on RTX 4090 cost model, links %.0f GB/s per direction\n",
      kLinkGbps);
  std::printf("balanced plan (auto_plan, D=8, fused): %s stages (fwd+fused+bwd)\n  %s\n",
              Stages(balanced).c_str(), balanced.to_string().c_str());
  std::printf(
      "plan (searched from it by simulation as the engine does with iteration overlap: %lld "
      "simulations, %.2f s; used for every D): %s stages\n  %s\n",
      (long long)searched.simulations, search_s, Stages(plan).c_str(), plan.to_string().c_str());
  std::printf(
      "RoundPipe: steady state of overlapping iterations as the engine runs them (the next call "
      "issued at the losses, one parameter copy; 4 warm-up iterations); single = one iteration "
      "alone\n");
  std::printf(
      "GPipe / 1F1B: the same layers in D balanced stages (with recomputation), one flush per "
      "iteration\n\n");
  std::printf("%3s %3s %10s %8s %8s %9s %9s %10s %9s %10s\n", "D", "M", "mb/s", "speedup", "bubble",
              "single", "gpipe", "gpipe mb/s", "1f1b", "1f1b mb/s");

  std::map<int64_t, SimResult> rp;
  std::map<int64_t, SimResult> gpipe, ofob;
  for (int64_t d : {1, 2, 4, 8}) {
    const int64_t m = d + 1;
    rp[d] = simulate_roundpipe(costs, plan,
                               SimOptions()
                                   .set_num_devices(d)
                                   .set_num_microbatch(m)
                                   .set_link_gbps(kLinkGbps)
                                   .set_overlap(IterationOverlap::kAfterLosses)
                                   .set_model_name("qwen3-1.7b"));
    const StageCosts stages = split_pipeline_stages(costs, d);
    gpipe[d] = simulate_pipeline(PipelineSchedule::kGPipe, stages, m, kLinkGbps);
    ofob[d] = simulate_pipeline(PipelineSchedule::k1F1B, stages, m, kLinkGbps);
    const double speedup = rp[d].throughput / rp[1].throughput;
    std::printf("%3lld %3lld %10.3f %8.2f %7.2f%% %8.2f%% %8.2f%% %10.3f %8.2f%% %10.3f\n",
                (long long)d, (long long)m, rp[d].throughput, speedup, 100 * rp[d].bubble,
                100 * rp[d].single_bubble, 100 * gpipe[d].bubble, gpipe[d].throughput,
                100 * ofob[d].bubble, ofob[d].throughput);
  }
  // Variants at D = 8, each changing one thing.
  auto d8 = [&](const ModelExecutePlan& p, double link, IterationOverlap overlap, SimAssignment assignment) {
    return simulate_roundpipe(costs, p,
                              SimOptions()
                                  .set_num_devices(8)
                                  .set_num_microbatch(9)
                                  .set_link_gbps(link)
                                  .set_overlap(overlap)
                                  .set_assignment(assignment));
  };
  const IterationOverlap engine = IterationOverlap::kAfterLosses;
  const SimAssignment predicted = SimAssignment::kPredictedStart;
  const SimResult free_links = d8(plan, kInfinity, engine, predicted);
  const SimResult every_call_at_once = d8(plan, kLinkGbps, IterationOverlap::kFull, predicted);
  const SimResult round_robin = d8(plan, kLinkGbps, engine, SimAssignment::kRoundRobin);
  const SimResult balanced_plan = d8(balanced, kLinkGbps, engine, predicted);
  const SimResult balanced_round_robin = d8(balanced, kLinkGbps, engine, SimAssignment::kRoundRobin);
  const double speedup8 = rp[8].throughput / rp[1].throughput;
  std::printf("\nD=8 with free transfers: bubble %.2f%%\n", 100 * free_links.bubble);
  std::printf("D=8, every iteration issued at once (the bound of overlap): bubble %.2f%%\n",
              100 * every_call_at_once.bubble);
  std::printf("D=8, round-robin devices: bubble %.2f%%\n", 100 * round_robin.bubble);
  std::printf("D=8, the balanced plan: bubble %.2f%% (round-robin %.2f%%)\n", 100 * balanced_plan.bubble,
              100 * balanced_round_robin.bubble);
  std::printf("targets (docs/guide.md): bubble_d8 <= 3%% %s, speedup_d8 >= 7.7 %s\n",
              rp[8].bubble <= 0.03 ? "met" : "NOT met", speedup8 >= 7.7 ? "met" : "NOT met");
  std::printf(
      "(the default: RoundPipeOptions::overlap_iterations = false gets the single column: "
      "docs/design/engine.md, B4)\n");
  std::printf("planner (engine/planner.h) called once per 20 ms: longest call %.3f ms on the caller; the searched "
              "plan %s after %lld calls; target plan_ms_on_caller < 50 %s\n",
              plan_ms_on_caller,
              adopted ? "adopted" : search_changes_plan ? "NOT adopted in time" : "equal to the balanced one,",
              (long long)planner_calls, plan_ms_on_caller < 50 ? "met" : "NOT met");
  std::printf(
      "\nRESULT id=B4 bubble_d8=%.4f speedup_d8=%.3f bubble_1f1b_d8=%.4f bubble_gpipe_d8=%.4f",
      rp[8].bubble, speedup8, ofob[8].bubble, gpipe[8].bubble);
  for (int64_t d : {1, 2, 4}) {
    std::printf(" speedup_d%lld=%.3f bubble_d%lld=%.4f", (long long)d,
                rp[d].throughput / rp[1].throughput, (long long)d, rp[d].bubble);
  }
  for (int64_t d : {1, 2, 4, 8}) {
    std::printf(" single_bubble_d%lld=%.4f", (long long)d, rp[d].single_bubble);
  }
  // bubble_d8_after_losses is bubble_d8 (the engine's lifecycle);
  // bubble_d8_predicted_start has every iteration issued at once.
  std::printf(
      " bubble_d8_free_links=%.4f mb_per_s_d8=%.3f gpipe_mb_per_s_d8=%.3f 1f1b_mb_per_s_d8=%.3f"
      " bubble_d8_after_losses=%.4f bubble_d8_predicted_start=%.4f bubble_d8_round_robin=%.4f"
      " bubble_d8_balanced_plan=%.4f bubble_d8_balanced_round_robin=%.4f search_simulations=%lld"
      " search_s=%.2f plan_ms_on_caller=%.3f plan_adopted_after_calls=%lld\n",
      free_links.bubble, rp[8].throughput, gpipe[8].throughput, ofob[8].throughput, rp[8].bubble,
      every_call_at_once.bubble, round_robin.bubble, balanced_plan.bubble, balanced_round_robin.bubble,
      (long long)searched.simulations, search_s, plan_ms_on_caller, (long long)(adopted ? planner_calls : -1));
  return 0;
}
