// Tests for the scheduler simulator: GPipe and 1F1B against the closed-form
// bubble, RoundPipe's timeline against the scheduler's jobs and FIFO order
// and the device model's rules, determinism and input errors. Times are
// virtual, so checks are exact where the arithmetic is.
#include "schedule/simulator.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "models.h"
#include "schedule/scheduler.h"

namespace roundpipe {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// n equal layers: fwd 1, recompute 1, bwd 2 ms.
LayerCosts EqualLayers(int64_t n, int64_t param_bytes = 0, int64_t act_bytes = 0) {
  LayerCosts c;
  c.fwd_ms.assign(n, 1.0);
  c.recompute_ms.assign(n, 1.0);
  c.bwd_ms.assign(n, 2.0);
  c.param_bytes.assign(n, param_bytes);
  c.activation_bytes.assign(n, act_bytes);
  return c;
}

// Uneven layers with transfers, so that links matter.
LayerCosts Uneven() {
  LayerCosts c;
  for (int64_t l = 0; l < 12; ++l) {
    const double f = 1.0 + (l * 7 % 5) * 0.5;
    c.fwd_ms.push_back(f);
    c.recompute_ms.push_back(f);
    c.bwd_ms.push_back(2 * f);
    c.param_bytes.push_back((10 + l * 3 % 7) * 1000000);
    c.activation_bytes.push_back(4000000);
  }
  return c;
}

ModelExecutePlan FusedPlan(const LayerCosts& c, int64_t d) {
  return auto_plan({c}, AutoPlanOptions().set_run_kind(RunKind::kFused).set_min_stages(d)).at(0);
}

StageCosts EqualStages(int64_t p, double f, double b) {
  return StageCosts{std::vector<double>(p, f), std::vector<double>(p, b), {}};
}

template <typename F>
std::string ErrorOf(F f) {
  return roundpipe::testing::value_error_of(f);
}

double End(const TraceEvent& e) { return e.start_us + e.dur_us; }

// ---- GPipe and 1F1B ----

TEST(SimulatorPipeline, GPipeBubbleMatchesClosedForm) {
  for (auto [p, m] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {2, 1}, {2, 4}, {3, 7}, {4, 4}, {4, 16}, {8, 9}, {8, 32}}) {
    const double expected = static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
    // Zero transfer cost two ways: no bytes, and bytes over an infinite link.
    SimResult a = simulate_pipeline(PipelineSchedule::kGPipe, EqualStages(p, 1.5, 3.0), m, 25.0);
    StageCosts with_bytes = EqualStages(p, 1.5, 3.0);
    with_bytes.output_bytes.assign(p, 1 << 20);
    SimResult b = simulate_pipeline(PipelineSchedule::kGPipe, with_bytes, m, kInf);
    for (const SimResult& r : {a, b}) {
      EXPECT_NEAR(r.bubble, expected, 0.01 * std::max(expected, 1e-9)) << "p=" << p << " m=" << m;
      EXPECT_DOUBLE_EQ(r.iteration_ms, (m + p - 1) * 4.5);
      EXPECT_DOUBLE_EQ(r.single_bubble, r.bubble);
    }
  }
}

TEST(SimulatorPipeline, OneFOneBHasGPipesBubbleWithEqualStages) {
  for (auto [p, m] :
       std::vector<std::pair<int64_t, int64_t>>{{2, 3}, {4, 4}, {4, 9}, {8, 9}, {8, 20}}) {
    SimResult g = simulate_pipeline(PipelineSchedule::kGPipe, EqualStages(p, 1, 2), m, 25.0);
    SimResult f = simulate_pipeline(PipelineSchedule::k1F1B, EqualStages(p, 1, 2), m, 25.0);
    EXPECT_NEAR(f.bubble, g.bubble, 1e-12) << "p=" << p << " m=" << m;
    EXPECT_DOUBLE_EQ(f.makespan_ms, g.makespan_ms);
  }
}

TEST(SimulatorPipeline, OneFOneBOrderPerDevice) {
  // p=3, m=4: stage 0 warms up with 2 forwards, stage 2 with none.
  SimResult r = simulate_pipeline(PipelineSchedule::k1F1B, EqualStages(3, 1, 2), 4, 25.0);
  std::map<int64_t, std::vector<std::string>> order;
  for (const TraceEvent& e : r.events) order[e.device].push_back(e.name);
  EXPECT_EQ(order[0],
            (std::vector<std::string>{"fwd s0 mb0", "fwd s0 mb1", "fwd s0 mb2", "bwd s0 mb0",
                                      "fwd s0 mb3", "bwd s0 mb1", "bwd s0 mb2", "bwd s0 mb3"}));
  EXPECT_EQ(order[2],
            (std::vector<std::string>{"fwd s2 mb0", "bwd s2 mb0", "fwd s2 mb1", "bwd s2 mb1",
                                      "fwd s2 mb2", "bwd s2 mb2", "fwd s2 mb3", "bwd s2 mb3"}));
}

TEST(SimulatorPipeline, TransfersDelayTheNextStage) {
  // 25 MB at 25 GB/s: 1 ms down, 1 ms up per hand-off.
  StageCosts s = EqualStages(2, 10, 20);
  s.output_bytes = {25000000, 0};
  SimResult r = simulate_pipeline(PipelineSchedule::kGPipe, s, 1, 25.0);
  EXPECT_DOUBLE_EQ(r.makespan_ms, 10 + 2 + 10 + 20 + 2 + 20);
}

TEST(SimulatorPipeline, SplitBalancesStages) {
  StageCosts s = split_pipeline_stages(EqualLayers(8, 0, 7), 4);
  EXPECT_EQ(s.fwd_ms, std::vector<double>(4, 2.0));
  EXPECT_EQ(s.bwd_ms, std::vector<double>(4, 6.0));  // recompute + backward
  EXPECT_EQ(s.output_bytes, std::vector<int64_t>(4, 7));
  EXPECT_EQ(split_pipeline_stages(EqualLayers(8), 4, /*recompute=*/false).bwd_ms,
            std::vector<double>(4, 4.0));
}

// ---- RoundPipe ----

struct Case {
  LayerCosts costs;
  ModelExecutePlan plan;
  SimOptions options;
};

std::vector<Case> Cases() {
  std::vector<Case> out;
  for (int64_t d : {1, 2, 3, 4}) {
    LayerCosts c = Uneven();
    out.push_back({c, FusedPlan(c, d), SimOptions().set_num_devices(d).set_num_microbatch(d + 1)});
  }
  LayerCosts c = Uneven();
  ModelExecutePlan train =
      auto_plan({c}, AutoPlanOptions().set_run_kind(RunKind::kTrain).set_min_stages(3)).at(0);
  out.push_back({c, train,
                 SimOptions()
                     .set_num_devices(3)
                     .set_num_microbatch(4)
                     .set_run_kind(RunKind::kTrain)
                     .set_output_bytes(1000000)
                     .set_input_bytes(500000)
                     .set_optimizer_ms(3)});
  out.push_back(
      {c, train,
       SimOptions().set_num_devices(2).set_num_microbatch(3).set_run_kind(RunKind::kInfer)});
  return out;
}

// The jobs of every call of the run, as the scheduler gives them.
std::vector<std::vector<JobSpec>> Calls(const Case& s, int64_t iterations) {
  std::vector<CallKind> kinds = s.options.run_kind == RunKind::kFused
                                    ? std::vector<CallKind>{CallKind::kFused}
                                : s.options.run_kind == RunKind::kTrain
                                    ? std::vector<CallKind>{CallKind::kForward, CallKind::kBackward}
                                    : std::vector<CallKind>{CallKind::kForward};
  Dispatcher dispatcher(s.options.num_devices);
  std::vector<std::vector<JobSpec>> calls;
  for (int64_t it = 0; it < iterations; ++it) {
    for (CallKind k : kinds) {
      calls.push_back(make_jobs(s.plan, k));
      assign_devices(dispatcher, calls.back(), s.costs, s.options, static_cast<int64_t>(calls.size()) - 1);
    }
  }
  return calls;
}

TEST(SimulatorRoundPipe, EveryJobAndMicrobatchComputedOnceInFifoOrder) {
  for (const Case& s : Cases()) {
    SimResult r = simulate_roundpipe(s.costs, s.plan, s.options);
    const std::vector<std::vector<JobSpec>> calls = Calls(s, r.iterations);
    const int64_t m = s.options.num_microbatch;
    // Expected per-device compute order: jobs in assignment order, each job's
    // microbatches in order (segments of one microbatch in layer order).
    using Key = std::tuple<int64_t, int64_t, int64_t>;  // (call, job index in the call, microbatch)
    std::map<int64_t, std::vector<Key>> expected, got;  // [device]
    std::map<Key, std::vector<LayerRange>> layers;      // compute segments
    std::map<Key, std::pair<double, double>> span;      // first start, last end
    for (size_t call = 0; call < calls.size(); ++call) {
      for (size_t j = 0; j < calls[call].size(); ++j) {
        for (int64_t mb = 0; mb < m; ++mb) {
          expected[calls[call][j].device].emplace_back(call, j, mb);
        }
      }
    }
    std::vector<TraceEvent> compute;
    for (const TraceEvent& e : r.events) {
      if (e.kind == "compute") compute.push_back(e);
    }
    std::stable_sort(compute.begin(), compute.end(), [](const TraceEvent& a, const TraceEvent& b) {
      return a.start_us < b.start_us;
    });
    for (const TraceEvent& e : compute) {
      // The job index within its call: find it by kind and stage.
      const std::vector<JobSpec>& jobs = calls.at(e.call);
      int64_t j = -1;
      for (size_t i = 0; i < jobs.size(); ++i) {
        if (jobs[i].stage == e.stage && job_kind_name(jobs[i].kind) == e.job)
          j = static_cast<int64_t>(i);
      }
      ASSERT_GE(j, 0) << e.name;
      EXPECT_EQ(jobs[j].device, e.device) << e.name;
      const Key key{e.call, j, e.microbatch};
      std::vector<LayerRange>& segs = layers[key];
      if (segs.empty()) got[e.device].push_back(key);
      segs.push_back(LayerRange{e.layer_begin, e.layer_end});
      auto [it, is_new] = span.emplace(key, std::make_pair(e.start_us, End(e)));
      it->second.second = End(e);
    }
    EXPECT_EQ(got, expected) << s.plan.to_string();
    // Each (job, microbatch) covers its layers exactly once, in order.
    for (const auto& [key, segs] : layers) {
      const JobSpec& job = calls[std::get<0>(key)][std::get<1>(key)];
      int64_t at = job.layers.begin;
      for (const LayerRange& seg : segs) {
        EXPECT_EQ(seg.begin, at);
        at = seg.end;
      }
      EXPECT_EQ(at, job.layers.end);
      // Job j's microbatch m starts after job j-1 finished it (plus the hand-off).
      const auto [call, j, mb] = key;
      if (j > 0) {
        const double ready = span.at({call, j - 1, mb}).second;
        const JobSpec& prev = calls[call][j - 1];
        const double handoff =
            prev.device == job.device ? 0.0 : 2 * 4000000 / (s.options.link_gbps * 1e3);
        EXPECT_GE(span.at(key).first, ready + handoff - 1e-6);
      }
    }
  }
}

TEST(SimulatorRoundPipe, LanesAndLinksNeverOverlapAndJobsFollowTheirTransfers) {
  for (const Case& s : Cases()) {
    SimResult r = simulate_roundpipe(s.costs, s.plan, s.options);
    // Compute lane, host-to-device link (both upload lanes), device-to-host link.
    std::map<std::pair<int64_t, int>, std::vector<std::pair<double, double>>> busy;
    for (const TraceEvent& e : r.events) {
      const int link = e.lane == TraceLane::kCompute ? 0 : e.lane == TraceLane::kDownload ? 2 : 1;
      busy[{e.device, e.lane == TraceLane::kOptimizer ? 3 : link}].emplace_back(e.start_us, End(e));
    }
    for (auto& [where, spans] : busy) {
      std::sort(spans.begin(), spans.end());
      for (size_t i = 1; i < spans.size(); ++i) {
        EXPECT_LE(spans[i - 1].second, spans[i].first + 1e-9)
            << "device " << where.first << " resource " << where.second;
      }
    }
    // Per job: parameters uploaded before its first compute; gradients
    // downloaded after its last one.
    std::map<std::pair<int64_t, std::string>, std::vector<const TraceEvent*>>
        jobs;  // (call, job stage)
    for (const TraceEvent& e : r.events) {
      if (e.device >= 0) jobs[{e.call, e.job + std::to_string(e.stage)}].push_back(&e);
    }
    for (const auto& [key, events] : jobs) {
      double first = kInf, last = 0;
      for (const TraceEvent* e : events) {
        if (e->kind == "compute") {
          first = std::min(first, e->start_us);
          last = std::max(last, End(*e));
        }
      }
      for (const TraceEvent* e : events) {
        if (e->kind == "upload") {
          EXPECT_LE(End(*e), first + 1e-9) << e->name;
        }
        if (e->kind == "download") {
          EXPECT_GE(e->start_us, last - 1e-9) << e->name;
        }
      }
    }
  }
}

TEST(SimulatorRoundPipe, AtMostTwoStagesOfParametersPerDevice) {
  for (const Case& s : Cases()) {
    SimResult r = simulate_roundpipe(s.costs, s.plan, s.options);
    // A stage's parameters live from its upload's start to its job's last compute.
    std::map<std::pair<int64_t, std::string>, std::pair<double, double>> life;
    std::map<std::pair<int64_t, std::string>, int64_t> device;
    for (const TraceEvent& e : r.events) {
      auto key = std::make_pair(e.call, e.job + std::to_string(e.stage));
      auto [it, is_new] = life.emplace(key, std::make_pair(kInf, 0.0));
      if (e.kind == "upload" || e.kind == "compute")
        it->second.first = std::min(it->second.first, e.start_us);
      if (e.kind == "compute") {
        it->second.second = std::max(it->second.second, End(e));
        device[key] = e.device;
      }
    }
    std::map<int64_t, std::vector<std::pair<double, int>>> edges;
    for (const auto& [key, span] : life) {
      if (!device.count(key)) continue;
      edges[device[key]].emplace_back(span.first, +1);
      // start_us + dur_us may round below the start of what it released.
      edges[device[key]].emplace_back(span.second - 1e-3, -1);
    }
    for (auto& [d, ev] : edges) {
      std::sort(ev.begin(), ev.end());  // ends (-1) before starts at equal times
      int live = 0;
      for (auto [t, delta] : ev) {
        live += delta;
        EXPECT_LE(live, 2) << "device " << d << " at " << t << " us";
      }
    }
  }
}

TEST(SimulatorRoundPipe, OneDeviceWithFreeTransfersHasNoBubble) {
  LayerCosts c = Uneven();
  for (RunKind kind : {RunKind::kFused, RunKind::kTrain, RunKind::kInfer}) {
    ModelExecutePlan plan =
        auto_plan({c}, AutoPlanOptions().set_run_kind(kind).set_min_stages(3)).at(0);
    SimResult r = simulate_roundpipe(
        c, plan, SimOptions().set_num_microbatch(2).set_run_kind(kind).set_link_gbps(kInf));
    EXPECT_NEAR(r.bubble, 0.0, 1e-12);
    EXPECT_NEAR(r.single_bubble, 0.0, 1e-12);
    // One device does all the work: an iteration is the sum of every stage's compute.
    double work = 0;
    for (int64_t l = 0; l < c.num_layers(); ++l) work += c.fwd_ms[l];
    if (kind != RunKind::kInfer) {
      for (int64_t l = 0; l < c.num_layers(); ++l) work += c.bwd_ms[l];
      const int64_t fused_begin = kind == RunKind::kFused ? plan.bwd_plan[0].begin : c.num_layers();
      for (int64_t l = 0; l < fused_begin; ++l) work += c.recompute_ms[l];
    }
    EXPECT_NEAR(r.iteration_ms, 2 * work, 1e-9);
    EXPECT_NEAR(r.throughput, 2 * 1e3 / r.iteration_ms, 1e-9);
  }
}

TEST(SimulatorRoundPipe, ChainedStagesPassDataAcrossDevices) {
  // Three one-layer forward stages on three devices (round-robin), 10 MB
  // hand-off at 10 GB/s: 1 ms down and 1 ms up between the stages.
  LayerCosts c = EqualLayers(3, 0, 10000000);
  ModelExecutePlan plan;
  plan.fwd_plan = {{0, 1}, {1, 2}, {2, 3}};
  SimOptions options = SimOptions()
                           .set_num_devices(3)
                           .set_num_microbatch(1)
                           .set_run_kind(RunKind::kInfer)
                           .set_link_gbps(10)
                           .set_assignment(SimAssignment::kRoundRobin);
  EXPECT_DOUBLE_EQ(simulate_roundpipe(c, plan, options).single_iteration_ms, 1 + 2 + 1 + 2 + 1);
  // By predicted start, with one microbatch each stage can start on the
  // device that just ran the stage before it (where it became free last):
  // no hand-off at all.
  options.set_assignment(SimAssignment::kPredictedStart);
  EXPECT_DOUBLE_EQ(simulate_roundpipe(c, plan, options).single_iteration_ms, 1 + 1 + 1);
  // A given assignment is replayed: stages 0 and 1 on device 2, stage 2 on
  // device 0: one hand-off.
  options.set_assignment(SimAssignment::kGiven).set_given_devices({{2, 2, 0}});
  const SimResult given = simulate_roundpipe(c, plan, options);
  EXPECT_DOUBLE_EQ(given.single_iteration_ms, 1 + 1 + 2 + 1);
  for (const TraceEvent& e : given.events) {
    if (e.kind == "compute") {
      EXPECT_EQ(e.device, e.stage == 2 ? 0 : 2) << e.name;
    }
  }
  options.set_given_devices({{0, 1}});
  EXPECT_THROW(simulate_roundpipe(c, plan, options), c10::ValueError);
  options.set_given_devices({{0, 1, 3}});
  EXPECT_THROW(simulate_roundpipe(c, plan, options), c10::ValueError);
  options.set_given_devices({});
  EXPECT_THROW(simulate_roundpipe(c, plan, options), c10::ValueError);
}

TEST(SimulatorRoundPipe, CpuExecutorIssuesAfterEachComputeAndCopiesWaitOutTheirDelay) {
  // One forward stage of one 10 ms layer, 3 microbatches, free links, every
  // copy delayed 2 ms. An accelerator's worker issues every copy at once:
  // the uploads are done at 2 ms, compute runs back to back, each output's
  // download is ready when its compute ends: 2 + 30 ms. A CPU device's
  // worker issues microbatch m + 1's upload when compute m ended, so each
  // microbatch waits out a delay, and so does the last output: 4 x 2 + 30 ms.
  LayerCosts c = EqualLayers(1, 1000, 1000);
  c.fwd_ms = {10};
  ModelExecutePlan plan;
  plan.fwd_plan = {{0, 1}};
  SimOptions o = SimOptions()
                     .set_num_microbatch(3)
                     .set_run_kind(RunKind::kInfer)
                     .set_link_gbps(kInf)
                     .set_input_bytes(1000)
                     .set_output_bytes(1000)
                     .set_copy_delay_ms(2);
  EXPECT_DOUBLE_EQ(simulate_roundpipe(c, plan, o).single_iteration_ms, 2 + 30);
  EXPECT_DOUBLE_EQ(simulate_roundpipe(c, plan, o.set_executor(SimExecutor::kCpu)).single_iteration_ms,
                   4 * 2 + 30);
  // Without a delay, running compute on the worker changes nothing here.
  EXPECT_DOUBLE_EQ(simulate_roundpipe(c, plan, o.set_copy_delay_ms(0)).single_iteration_ms, 30);
  // A delay does not occupy the link: the three uploads issued together
  // wait it out together and all end at 2 ms.
  SimResult r = simulate_roundpipe(c, plan, o.set_executor(SimExecutor::kAccelerator).set_copy_delay_ms(2));
  int uploads = 0;
  for (const TraceEvent& e : r.events) {
    if (e.call != 0 || e.kind != "handoff" || e.name.rfind("in ", 0) != 0) continue;
    ++uploads;
    EXPECT_DOUBLE_EQ(End(e), 2000.0) << e.name;
  }
  EXPECT_EQ(uploads, 3);
}

TEST(SimulatorRoundPipe, AfterLossesIssuesAtTheLossesAndUploadsAfterThePreviousCallsLastUpload) {
  LayerCosts c = Uneven();
  const ModelExecutePlan plan = FusedPlan(c, 4);
  SimOptions o = SimOptions().set_num_devices(4).set_num_microbatch(5).set_link_gbps(25);
  const SimResult full = simulate_roundpipe(c, plan, o);
  const SimResult r = simulate_roundpipe(c, plan, o.set_overlap(IterationOverlap::kAfterLosses));
  EXPECT_GE(r.iteration_ms, full.iteration_ms - 1e-9);  // full overlap is the bound
  EXPECT_EQ(r.single_iteration_ms, full.single_iteration_ms);
  // Per call: when its losses were known (its last fused compute ended), its
  // first event, and per layer its last upload's end and first upload's start.
  std::map<int64_t, double> losses, first;
  std::map<std::pair<int64_t, int64_t>, double> last_upload_end, first_upload_start;
  for (const TraceEvent& e : r.events) {
    first.emplace(e.call, e.start_us);
    first[e.call] = std::min(first[e.call], e.start_us);
    if (e.kind == "compute" && e.job == "fused") losses[e.call] = std::max(losses[e.call], End(e));
    if (e.kind != "upload") continue;
    for (int64_t l = e.layer_begin; l < e.layer_end; ++l) {
      auto key = std::make_pair(e.call, l);
      last_upload_end[key] = std::max(last_upload_end[key], End(e));
      if (!first_upload_start.count(key) || e.start_us < first_upload_start[key]) first_upload_start[key] = e.start_us;
    }
  }
  ASSERT_GE(losses.size(), 3u);
  bool overlapped = false;
  for (const auto& [call, start] : first) {
    if (call == 0) continue;
    EXPECT_GE(start, losses.at(call - 1)) << "call " << call;
    for (int64_t l = 0; l < c.num_layers(); ++l) {
      EXPECT_GE(first_upload_start.at({call, l}), last_upload_end.at({call - 1, l})) << "call " << call << " layer " << l;
    }
    // The calls do overlap: this one starts before the previous one's last event.
    double previous_end = 0;
    for (const TraceEvent& e : r.events) {
      if (e.call == call - 1) previous_end = std::max(previous_end, End(e));
    }
    overlapped = overlapped || start < previous_end;
  }
  EXPECT_TRUE(overlapped);
}

TEST(SimulatorRoundPipe, OptimizerStepBoundsTheIterationTime) {
  LayerCosts c = EqualLayers(4);
  SimResult r = simulate_roundpipe(
      c, FusedPlan(c, 2),
      SimOptions().set_num_devices(2).set_num_microbatch(3).set_optimizer_ms(1000));
  EXPECT_NEAR(r.iteration_ms, 1000, 1e-6);
  int steps = 0;
  for (const TraceEvent& e : r.events) steps += e.kind == "optimizer" && e.device == -1;
  EXPECT_EQ(steps, r.iterations);
}

TEST(SimulatorRoundPipe, Deterministic) {
  for (const Case& s : Cases()) {
    SimResult a = simulate_roundpipe(s.costs, s.plan, s.options);
    SimResult b = simulate_roundpipe(s.costs, s.plan, s.options);
    EXPECT_EQ(chrome_trace_json(a.events, {}), chrome_trace_json(b.events, {}));
    EXPECT_EQ(a.iteration_ms, b.iteration_ms);
    EXPECT_EQ(a.bubble, b.bubble);
    EXPECT_EQ(a.single_bubble, b.single_bubble);
    EXPECT_EQ(a.busy_ms, b.busy_ms);
  }
}

TEST(SimulatorRoundPipe, MeasuresWholeRoundRobinPeriods) {
  LayerCosts c = Uneven();
  ModelExecutePlan plan = FusedPlan(c, 4);  // jobs per iteration vs 4 devices
  const int64_t jobs = static_cast<int64_t>(plan.fwd_plan.size() + plan.bwd_plan.size());
  const int64_t period = 4 / std::gcd(jobs, int64_t{4});
  SimResult r = simulate_roundpipe(c, plan, SimOptions().set_num_devices(4).set_num_microbatch(5));
  EXPECT_EQ(r.measured_iterations % period, 0);
  EXPECT_GE(r.measured_iterations, 8);
  EXPECT_EQ(r.iterations, 4 + r.measured_iterations + 2);
  EXPECT_GT(r.throughput, 0);
  EXPECT_GE(r.bubble, 0);
  EXPECT_LT(r.bubble, 1);
}

TEST(SimulatorErrors, ClearMessages) {
  LayerCosts c = EqualLayers(4);
  ModelExecutePlan plan = FusedPlan(c, 2);
  auto run = [&](SimOptions o, LayerCosts costs = {}) {
    return ErrorOf([&] { simulate_roundpipe(costs.fwd_ms.empty() ? c : costs, plan, o); });
  };
  EXPECT_NE(run(SimOptions().set_num_devices(0)).find("num_devices must be >= 1"),
            std::string::npos);
  EXPECT_NE(run(SimOptions().set_num_microbatch(0)).find("num_microbatch must be >= 1"),
            std::string::npos);
  EXPECT_NE(run(SimOptions().set_link_gbps(0)).find("link_gbps must be > 0"), std::string::npos);
  EXPECT_NE(run(SimOptions().set_optimizer_ms(-1)).find("optimizer_ms"), std::string::npos);
  EXPECT_NE(run(SimOptions().set_copy_delay_ms(-1)).find("copy_delay_ms must be finite and >= 0"),
            std::string::npos);
  EXPECT_NE(run(SimOptions().set_warmup_iterations(-1)).find("warmup_iterations"),
            std::string::npos);
  LayerCosts negative = c;
  negative.bwd_ms[2] = -1;
  EXPECT_NE(run(SimOptions(), negative).find("bwd_ms[2] is -1"), std::string::npos);
  EXPECT_NE(
      ErrorOf([&] { simulate_roundpipe(c, plan, SimOptions().set_run_kind(RunKind::kTrain)); }),
      "");
  // One stage on two devices: iterations 2 and 3 end together.
  ModelExecutePlan one_stage;
  one_stage.fwd_plan = {{0, 4}};
  EXPECT_NE(ErrorOf([&] {
              simulate_roundpipe(c, one_stage,
                                 SimOptions()
                                     .set_num_devices(2)
                                     .set_run_kind(RunKind::kInfer)
                                     .set_warmup_iterations(3)
                                     .set_measured_iterations(1));
            }).find("measure a multiple of the round-robin period (2 iterations here)"),
            std::string::npos);
  EXPECT_NE(
      ErrorOf([&] { split_pipeline_stages(c, 5); }).find("cannot split 4 layers into 5 stages"),
      std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              simulate_pipeline(PipelineSchedule::kGPipe, StageCosts{{1, 2}, {1}, {}}, 2, 25);
            }).find("give one of each per stage"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              simulate_pipeline(PipelineSchedule::kGPipe, EqualStages(2, -1, 1), 2, 25);
            }).find("finite and >= 0"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              simulate_pipeline(PipelineSchedule::kGPipe, EqualStages(2, 1, 1), 0, 25);
            }).find("num_microbatch"),
            std::string::npos);
}

TEST(SimulatorRoundPipe, PredictedStartAssignmentRunsEveryJobWhereTheDispatcherPutIt) {
  // The FIFO test above covers round-robin; here the Dispatcher is fed the
  // simulated costs, and the devices still run what it assigned, in order.
  for (Case s : Cases()) {
    s.options.set_assignment(SimAssignment::kPredictedStart);
    SimResult r = simulate_roundpipe(s.costs, s.plan, s.options);
    const std::vector<std::vector<JobSpec>> calls = Calls(s, r.iterations);
    for (const TraceEvent& e : r.events) {
      if (e.kind != "compute") continue;
      const std::vector<JobSpec>& jobs = calls.at(e.call);
      bool found = false;
      for (const JobSpec& j : jobs) {
        found = found || (job_kind_name(j.kind) == e.job && j.stage == e.stage && j.device == e.device);
      }
      EXPECT_TRUE(found) << e.name << " of call " << e.call << " on device " << e.device;
    }
    EXPECT_GE(r.bubble, 0);
    EXPECT_LT(r.bubble, 1);
  }
}

}  // namespace
}  // namespace roundpipe
