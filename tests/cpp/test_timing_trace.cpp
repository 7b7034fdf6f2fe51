// Per-layer timing (ModelTimer), timeline traces of real runs, and the
// simulator against a real run.
#include <gtest/gtest.h>
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <future>
#include <limits>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "copy_delay.h"
#include "engine/host_store.h"
#include "engine/layer_handle.h"
#include "engine/trace_recorder.h"
#include "engine/transfers.h"
#include "models.h"
#include "roundpipe/devices.h"
#include "runtime/device_pool.h"
#include "schedule/simulator.h"

namespace roundpipe {
namespace {

using testing::make_mlp;

// ---- ModelTimer ----

TEST(ModelTimer, DiscardsTheFirstRecordThenAveragesWithBiasCorrection) {
  ModelTimer timer(2);
  timer.record(1, LayerAction::kForward, 100.0);  // warm-up, discarded
  EXPECT_FALSE(timer.estimate(1, LayerAction::kForward).has_value());
  EXPECT_EQ(timer.num_records(1, LayerAction::kForward), 0);
  timer.record(1, LayerAction::kForward, 10.0);
  EXPECT_DOUBLE_EQ(*timer.estimate(1, LayerAction::kForward), 10.0);  // the first kept record
  timer.record(1, LayerAction::kForward, 20.0);
  // m = 0.9 * (0.1 * 10) + 0.1 * 20 = 2.9; estimate = m / (1 - 0.9^2) = 2.9 / 0.19.
  EXPECT_NEAR(*timer.estimate(1, LayerAction::kForward), 2.9 / 0.19, 1e-12);
  EXPECT_EQ(timer.num_records(1, LayerAction::kForward), 2);
  // Other layers and actions are separate.
  EXPECT_FALSE(timer.estimate(0, LayerAction::kForward).has_value());
  EXPECT_FALSE(timer.estimate(1, LayerAction::kBackward).has_value());
}

TEST(ModelTimer, VerboseLineFormat) {
  ModelTimer timer(1);
  ModelTimer::set_verbose(true);
  ::testing::internal::CaptureStderr();
  timer.record(0, LayerAction::kBackward, 5.0);  // discarded: no line
  timer.record(0, LayerAction::kBackward, 2.5);
  timer.record(0, LayerAction::kBackward, 3.5);
  const std::string out = ::testing::internal::GetCapturedStderr();
  ModelTimer::set_verbose(false);
  std::ostringstream want;
  char line[160];
  std::snprintf(line, sizeof(line), "Layer 0 bwd  new record: 2.500 ms  new estimate: 2.500 ms\n"
                                    "Layer 0 bwd  new record: 3.500 ms  new estimate: %.3f ms\n",
                (0.9 * 0.25 + 0.35) / 0.19);
  EXPECT_EQ(out, line);
}

TEST(ModelTimer, StateRoundTripAndErrors) {
  ModelTimer a(3);
  for (double ms : {1.0, 2.0, 3.0}) a.record(2, LayerAction::kRecompute, ms);
  ModelTimer b(3);
  b.load_state(a.state());
  EXPECT_DOUBLE_EQ(*b.estimate(2, LayerAction::kRecompute), *a.estimate(2, LayerAction::kRecompute));
  EXPECT_THROW(ModelTimer(2).load_state(a.state()), c10::ValueError);
  EXPECT_THROW(a.record(3, LayerAction::kForward, 1.0), c10::ValueError);
  EXPECT_THROW(a.record(0, LayerAction::kForward, -1.0), c10::ValueError);
  EXPECT_THROW(a.record(0, LayerAction::kForward, std::nan("")), c10::ValueError);
  a.reset();
  EXPECT_FALSE(a.estimate(2, LayerAction::kRecompute).has_value());
}

// ---- Overlap of uploads and compute ----

TEST(Overlap, NextStageUploadsWhileThisStageComputesAndComputeWaitsOnlyForItsOwnStage) {
  // One device runs every job; layers compute for 3 ms and copies complete
  // 4 ms after they are issued. The prefetch of job k+1's parameters must
  // run during job k's compute; job k's first compute must start after job
  // k's own upload completed, but before job k+1's did.
  auto& dev = *testing::slow_cpu_devices().at(0);
  testing::CopyDelay delay(4000);
  dev.set_layer_delay(std::chrono::microseconds(3000));
  torch::manual_seed(1);
  torch::nn::Sequential net;
  for (int i = 0; i < 4; ++i) net->push_back(torch::nn::Linear(64, 64));
  RoundPipe model(net, RoundPipeOptions().set_max_devices(1));
  ModelExecutePlan plan;
  plan.fwd_plan = {{0, 1}, {1, 2}, {2, 3}};
  plan.bwd_plan = {{3, 4}, {2, 3}, {1, 2}, {0, 1}};
  const RunConfig cfg = RunConfig().num_microbatch(3).execute_plan(plan);
  at::Tensor x = torch::randn({6, 64});
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue&) -> c10::IValue { return out.toTensor().square().mean(); };
  std::string path_buf = ::testing::TempDir() + "roundpipe_overlap_XXXXXX";
  char* path = path_buf.data();
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  start_trace(path);
  model.forward_backward({x}, make_kwargs(), c10::IValue(), loss_fn, false, cfg);
  model.synchronize();  // a call's events are traced once it has ended
  std::vector<TraceEvent> events = Tracer::instance().events();
  stop_trace();
  dev.set_layer_delay(std::chrono::microseconds(0));
  std::remove(path);

  // Per job (kind, stage): its parameter upload and its compute interval.
  struct Interval {
    double begin = 1e300, end = -1e300;
  };
  std::map<std::pair<std::string, int64_t>, Interval> upload, compute;
  std::map<std::pair<std::string, int64_t>, double> first_compute;
  for (const TraceEvent& e : events) {
    const auto job = std::make_pair(e.job, e.stage);
    Interval* in = e.kind == "upload" ? &upload[job] : e.kind == "compute" ? &compute[job] : nullptr;
    if (in == nullptr) continue;
    in->begin = std::min(in->begin, e.start_us);
    in->end = std::max(in->end, e.start_us + e.dur_us);
  }
  ASSERT_EQ(compute.size(), 7u);
  ASSERT_EQ(upload.size(), 7u);
  // Jobs in the order the device ran them.
  std::vector<std::pair<std::string, int64_t>> order;
  for (const auto& [job, in] : compute) order.push_back(job);
  std::sort(order.begin(), order.end(), [&](const auto& a, const auto& b) { return compute[a].begin < compute[b].begin; });
  for (size_t k = 0; k < order.size(); ++k) {
    const std::string name = order[k].first + " stage " + std::to_string(order[k].second);
    EXPECT_GE(compute[order[k]].begin, upload[order[k]].end) << name << " computed before its parameters arrived";
    if (k + 1 == order.size()) continue;
    const Interval& next_upload = upload[order[k + 1]];
    EXPECT_LT(compute[order[k]].begin, next_upload.end)
        << name << " waited for the next stage's parameters before computing";
    EXPECT_LT(next_upload.begin, compute[order[k]].end) << "the next stage's upload did not overlap " << name;
  }
}

// ---- Timing in real runs ----

LossFn mse() { return testing::mse_loss_fn(); }

// Layers 0..8 of make_mlp(16, 4): fused stage [6, 9), forward [0, 3), [3, 6),
// backward [3, 6), [0, 3).
ModelExecutePlan fused_plan() {
  ModelExecutePlan plan;
  plan.fwd_plan = {{0, 3}, {3, 6}};
  plan.bwd_plan = {{6, 9}, {3, 6}, {0, 3}};
  return plan;
}

void expect_timed(const RoundPipe& model, int64_t layer, LayerAction action) {
  c10::optional<double> ms = model.timer().estimate(layer, action);
  ASSERT_TRUE(ms.has_value()) << "layer " << layer << " " << layer_action_name(action);
  EXPECT_TRUE(std::isfinite(*ms) && *ms >= 0) << *ms;
}

class RealRunTiming : public ::testing::TestWithParam<RecomputeGrain> {};

TEST_P(RealRunTiming, EveryLayerGetsItsActionsTimedAfterTheFirstCall) {
  torch::manual_seed(0);
  RoundPipe model(make_mlp(), RoundPipeOptions().set_max_devices(2));
  const RunConfig cfg = RunConfig().num_microbatch(3).execute_plan(fused_plan()).recompute_grain(GetParam());
  at::Tensor x = torch::randn({6, 16}), y = torch::randn({6, 4});
  model.forward_backward({x}, make_kwargs(), y, mse(), false, cfg);
  model.synchronize();  // a call's timings are recorded once it has ended
  for (int64_t l = 0; l < 9; ++l) EXPECT_FALSE(model.timer().estimate(l, LayerAction::kForward).has_value());
  model.forward_backward({x}, make_kwargs(), y, mse(), false, cfg);
  model.synchronize();
  for (int64_t l = 0; l < 9; ++l) {
    expect_timed(model, l, LayerAction::kForward);
    expect_timed(model, l, LayerAction::kBackward);
    // Layers outside the fused stage are recomputed by their backward stage.
    if (l < 6) expect_timed(model, l, LayerAction::kRecompute);
    if (l >= 6) {
      EXPECT_FALSE(model.timer().estimate(l, LayerAction::kRecompute).has_value());
    }
  }
  // The planner now sees these times.
  const LayerCosts costs = model.layer_costs();
  for (int64_t l = 0; l < 9; ++l) {
    EXPECT_EQ(costs.fwd_ms[l], *model.timer().estimate(l, LayerAction::kForward));
    EXPECT_EQ(costs.bwd_ms[l], *model.timer().estimate(l, LayerAction::kBackward));
  }
}

INSTANTIATE_TEST_SUITE_P(Grain, RealRunTiming, ::testing::Values(RecomputeGrain::kStage, RecomputeGrain::kLayer));

TEST(Timing, CostsAreParameterSizesUntilTimed) {
  RoundPipe model(make_mlp(), RoundPipeOptions().set_max_devices(2));
  const LayerCosts costs = model.layer_costs();
  EXPECT_EQ(costs.fwd_ms[0], 16.0 * 16 * 4 + 16 * 4);  // Linear(16, 16): bytes of weight and bias
  EXPECT_EQ(costs.fwd_ms[1], 0.0);                     // Tanh
  EXPECT_EQ(costs.bwd_ms[0], 2 * costs.fwd_ms[0]);
  // The default plan is valid for every kind and spans every device.
  for (RunKind kind : {RunKind::kInfer, RunKind::kTrain, RunKind::kFused}) {
    const ModelExecutePlan plan = model.default_execute_plan(kind);
    EXPECT_NO_THROW(plan.validate(9, kind));
    EXPECT_EQ(model.default_execute_plan(kind), plan);  // asked again: unchanged
  }
}

TEST(Timing, ModelPlanForForwardBackwardIsAccepted) {
  // A model-wide plan may be a forward_backward plan.
  RoundPipe model(make_mlp(), RoundPipeOptions().set_max_devices(2).set_run_config(
                                  RunConfig().num_microbatch(2).execute_plan(fused_plan())));
  at::Tensor x = torch::randn({4, 16}), y = torch::randn({4, 4});
  EXPECT_NO_THROW(model.forward_backward({x}, make_kwargs(), y, mse()));
  ModelExecutePlan broken;
  broken.fwd_plan = {{0, 3}};
  broken.bwd_plan = {{5, 9}, {0, 5}};
  EXPECT_THROW(RoundPipe(make_mlp(), RoundPipeOptions().set_run_config(RunConfig().execute_plan(broken))),
               c10::ValueError);
}

// ---- Traces ----

struct TracedRun {
  nlohmann::json events;  // the "X" events
  std::map<int64_t, std::string> process_names;
};

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/" + name + "." + std::to_string(::getpid()) + ".json";
}

// Three async iterations of the MLP on two devices, traced.
TracedRun traced_run(const std::string& path, int64_t iterations = 3) {
  torch::manual_seed(1);
  torch::nn::Sequential net = make_mlp();
  RoundPipe model(net, RoundPipeOptions().set_max_devices(std::min<int64_t>(2, get_num_devices())).set_name("traced"));
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.01));
  const RunConfig cfg = RunConfig().num_microbatch(3).execute_plan(fused_plan());
  start_trace(path);
  for (int64_t i = 0; i < iterations; ++i) {
    at::Tensor x = torch::randn({6, 16}), y = torch::randn({6, 4});
    model.forward_backward({x}, make_kwargs(), y, mse(), false, cfg);
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
  }
  model.synchronize();
  stop_trace();
  std::ifstream in(path);
  nlohmann::json trace = nlohmann::json::parse(in);  // throws if not JSON
  TracedRun run;
  run.events = nlohmann::json::array();
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "X") run.events.push_back(e);
    if (e.at("ph") == "M" && e.at("name") == "process_name") {
      run.process_names[e.at("pid").get<int64_t>()] = e.at("args").at("name").get<std::string>();
    }
  }
  return run;
}

TEST(Trace, RealRunWritesChromeTraceWithJobsInOrderOnTheirDevice) {
  const std::string path = temp_path("trace");
  TracedRun run = traced_run(path);
  EXPECT_FALSE(tracing());
  EXPECT_EQ(run.process_names[0], "host");
  EXPECT_EQ(run.process_names[1], get_device_names().front());

  // Per job (call, stage, job kind): its device and the times of its events.
  struct Job {
    std::set<int64_t> pids;
    double upload_end = -1, first_compute = 1e300, last_compute_end = -1, first_download = 1e300;
    int64_t computes = 0;
  };
  std::map<std::tuple<int64_t, std::string, int64_t>, Job> jobs;
  int64_t steps = 0;
  for (const auto& e : run.events) {
    const double ts = e.at("ts").get<double>(), dur = e.at("dur").get<double>();
    EXPECT_GE(ts, 0.0);
    EXPECT_GE(dur, 0.0);
    const std::string cat = e.at("cat");
    if (cat == "optimizer") {
      EXPECT_EQ(e.at("pid"), 0);
      if (e.at("name").get<std::string>().rfind("step ", 0) == 0) ++steps;
      continue;
    }
    const auto& a = e.at("args");
    EXPECT_EQ(a.at("model"), "traced");
    Job& job = jobs[{a.at("call").get<int64_t>(), a.at("job").get<std::string>(), a.at("stage").get<int64_t>()}];
    if (cat == "handoff") continue;  // activations may travel before or after their compute
    job.pids.insert(e.at("pid").get<int64_t>());
    if (cat == "upload") job.upload_end = std::max(job.upload_end, ts + dur);
    if (cat == "compute") {
      ++job.computes;
      job.first_compute = std::min(job.first_compute, ts);
      job.last_compute_end = std::max(job.last_compute_end, ts + dur);
      EXPECT_GE(a.at("microbatch").get<int64_t>(), 0);
    }
    if (cat == "download") job.first_download = std::min(job.first_download, ts);
  }
  EXPECT_EQ(steps, 3);
  EXPECT_EQ(jobs.size(), 3u * 5u);  // 3 calls x (2 forward + fused + 2 backward)
  for (const auto& [key, job] : jobs) {
    SCOPED_TRACE("call " + std::to_string(std::get<0>(key)) + " " + std::get<1>(key) + " stage " +
                 std::to_string(std::get<2>(key)));
    EXPECT_EQ(job.pids.size(), 1u);  // one device
    EXPECT_EQ(job.computes, 3);      // one per microbatch
    EXPECT_GE(job.upload_end, 0.0);
    EXPECT_LE(job.upload_end, job.first_compute);
    if (std::get<1>(key) != "forward") {
      EXPECT_LE(job.last_compute_end, job.first_download);
    }
  }
  std::remove(path.c_str());
}

// A stage upload behind a closed parameter gate: the worker issues it and
// goes on; the lane waits, and the timed upload's marks show the wait
// (gate_start .. start, the trace's "wait" span) apart from the copy
// (start .. end).
void expect_a_gated_upload_traced_as_wait_then_copy(Device& dev) {
  torch::nn::Linear linear(64, 64);
  std::vector<std::shared_ptr<LayerHandle>> layers = {
      make_module_layer(torch::nn::AnyModule(linear), 0)};
  HostStore store(layers, PinMode::kAlloc, /*page_lock=*/false);
  ParamGate gate(1);
  const int64_t generation = gate.begin_write();
  ModelView model{"gated", &layers, &store, 0, 0, &gate, generation, nullptr};
  StageTensors st;
  std::promise<void> issued;
  dev.submit([&] {
    st = upload_stage(dev, model, LayerRange{0, 1}, /*timed=*/true);
    issued.set_value();
  });
  const bool worker_free = issued.get_future().wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // the gate stays closed 30 ms at least
  gate.mark_written(0, generation);
  ASSERT_TRUE(worker_free) << "the worker waited for the gate";
  ASSERT_TRUE(st.gate_start && st.start && st.end && st.uploaded);
  st.uploaded->synchronize();
  EXPECT_GE(st.start->ms_since(*st.gate_start), 30.0) << "the wait lasts until the gate opens";
  EXPECT_GE(st.end->ms_since(*st.start), 0.0);
  EXPECT_TRUE(st.params[0][0].cpu().equal(linear->weight));
  EXPECT_TRUE(st.params[0][1].cpu().equal(linear->bias));
}

TEST(Trace, AnUploadWaitingForTheOptimizerShowsTheWaitApartFromTheCopy) {
  if (get_device_names().front().rfind("cpu", 0) != 0) GTEST_SKIP() << "the Gpu test of the same name on accelerators";
  expect_a_gated_upload_traced_as_wait_then_copy(DevicePool::instance().device(0));
}

TEST(Gpu, AnUploadWaitingForTheOptimizerShowsTheWaitApartFromTheCopy) {
  if (get_device_names().front().rfind("cuda", 0) != 0) GTEST_SKIP() << "needs ROUNDPIPE_DEVICES=cuda";
  expect_a_gated_upload_traced_as_wait_then_copy(DevicePool::instance().device(0));
}

TEST(Trace, EnvironmentVariableTracesAndErrorsAreClear) {
  EXPECT_THROW(start_trace(""), c10::ValueError);
  EXPECT_NO_THROW(stop_trace());  // not tracing: no-op
  start_trace("/nonexistent-dir/trace.json");
  EXPECT_THROW(stop_trace(), c10::Error);
  EXPECT_FALSE(tracing());
}

// ---- The simulator against a real run ----

// Per device, the order of (call, job kind, stage, microbatch) of its compute.
std::map<int64_t, std::vector<std::tuple<int64_t, std::string, int64_t, int64_t>>> compute_order(
    const std::vector<std::tuple<int64_t, int64_t, std::string, int64_t, int64_t, double>>& events) {
  auto sorted = events;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const auto& a, const auto& b) { return std::get<5>(a) < std::get<5>(b); });
  std::map<int64_t, std::vector<std::tuple<int64_t, std::string, int64_t, int64_t>>> out;
  for (const auto& [device, call, job, stage, mb, ts] : sorted) {
    auto& seq = out[device];
    auto item = std::make_tuple(call, job, stage, mb);
    if (seq.empty() || seq.back() != item) seq.push_back(item);  // segments of one microbatch
  }
  return out;
}

TEST(Simulator, AgreesWithARealRunOnTheOrderOfJobsAndStageUploadsPerDevice) {
  const std::string path = temp_path("order");
  const int64_t iterations = 3;
  TracedRun run = traced_run(path, iterations);
  std::vector<std::tuple<int64_t, int64_t, std::string, int64_t, int64_t, double>> real;
  std::vector<std::tuple<int64_t, int64_t, std::string, int64_t, int64_t, double>> real_uploads;
  for (const auto& e : run.events) {
    const auto& a = e.at("args");
    const int64_t device = e.at("pid").get<int64_t>() - 1;
    if (e.at("cat") == "upload") {
      real_uploads.emplace_back(device, a.at("call").get<int64_t>(), a.at("job").get<std::string>(),
                                a.at("stage").get<int64_t>(), -1, e.at("ts").get<double>());
    }
    if (e.at("cat") != "compute") continue;
    real.emplace_back(device, a.at("call").get<int64_t>(), a.at("job").get<std::string>(),
                      a.at("stage").get<int64_t>(), a.at("microbatch").get<int64_t>(), e.at("ts").get<double>());
  }
  // The simulator, fed with this run's measured costs (a model with the same
  // layers, timed by the same kind of run).
  torch::manual_seed(1);
  RoundPipe timed(make_mlp(), RoundPipeOptions().set_max_devices(2));
  const RunConfig cfg = RunConfig().num_microbatch(3).execute_plan(fused_plan());
  for (int i = 0; i < 3; ++i) {
    timed.forward_backward({torch::randn({6, 16})}, make_kwargs(), torch::randn({6, 4}), mse(), false, cfg);
  }
  // The devices the run gave its jobs: the engine's dispatcher decided from
  // its own estimates at each call (and round-robin from earlier calls of
  // the process before they existed), which the simulator replays.
  const int64_t num_fwd = static_cast<int64_t>(fused_plan().fwd_plan.size());
  std::vector<std::vector<int64_t>> given(iterations, std::vector<int64_t>(fused_plan().bwd_plan.size() + num_fwd, -1));
  for (const auto& [device, call, job, stage, mb, ts] : real) {
    const int64_t index = job == "forward" ? stage : num_fwd + stage;  // make_jobs order
    given.at(call).at(index) = device;
  }
  SimOptions options;
  options.set_num_devices(2).set_num_microbatch(3).set_run_kind(RunKind::kFused);
  options.set_assignment(SimAssignment::kGiven).set_given_devices(given);
  SimResult sim = simulate_roundpipe(timed.layer_costs(), fused_plan(), options);
  std::vector<std::tuple<int64_t, int64_t, std::string, int64_t, int64_t, double>> predicted;
  std::vector<std::tuple<int64_t, int64_t, std::string, int64_t, int64_t, double>> predicted_uploads;
  for (const TraceEvent& e : sim.events) {
    if (e.call >= iterations) continue;
    const int64_t device = e.device;
    if (e.kind == "upload") predicted_uploads.emplace_back(device, e.call, e.job, e.stage, -1, e.start_us);
    if (e.kind != "compute") continue;
    predicted.emplace_back(device, e.call, e.job, e.stage, e.microbatch, e.start_us);
  }
  const auto want = compute_order(real), got = compute_order(predicted);
  ASSERT_EQ(want.size(), 2u);
  size_t total = 0;
  for (const auto& [device, seq] : want) total += seq.size();
  EXPECT_EQ(total, static_cast<size_t>(iterations * 5 * 3));  // calls x jobs x microbatches
  EXPECT_EQ(got, want);
  // Both run the same lane programs: every stage is uploaded once, on the
  // device of its job, in the same order on each device's parameter lane.
  const auto want_uploads = compute_order(real_uploads), got_uploads = compute_order(predicted_uploads);
  size_t uploads = 0;
  for (const auto& [device, seq] : want_uploads) uploads += seq.size();
  EXPECT_EQ(uploads, static_cast<size_t>(iterations * 5));
  EXPECT_EQ(got_uploads, want_uploads);
  std::remove(path.c_str());
}

// ---- The simulator calibrated against a real run ----

// The identity with a backward that takes `us` microseconds.
struct SlowBackward : torch::autograd::Function<SlowBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t us) {
    ctx->saved_data["us"] = us;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    std::this_thread::sleep_for(std::chrono::microseconds(ctx->saved_data["us"].toInt()));
    return {grads.at(0), at::Tensor()};
  }
};

// A layer whose forward (and so its recomputation) takes fwd_us and whose
// backward takes bwd_us, whatever the machine: its time is sleep, not
// arithmetic, so the run's timing does not depend on how many cores the
// devices share.
struct TimedLayerImpl : torch::nn::Cloneable<TimedLayerImpl> {
  TimedLayerImpl(int64_t width, int64_t fwd_us, int64_t bwd_us) : width(width), fwd_us(fwd_us), bwd_us(bwd_us) {
    reset();
  }
  void reset() override { linear = register_module("linear", torch::nn::Linear(width, width)); }
  at::Tensor forward(const at::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::microseconds(fwd_us));
    return SlowBackward::apply(linear(x), bwd_us);
  }
  int64_t width, fwd_us, bwd_us;
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(TimedLayer);

// The calibration runs: three CPU devices whose copies complete 4 ms after
// they are issued, layers of unequal, fixed times, 3 forward + fused + 3
// backward stages, M = 4.
constexpr int64_t kCalWidth = 32, kCalBatch = 8, kCalMicrobatches = 4, kCalDevices = 3;
constexpr double kCalCopyDelayMs = 4.0;
const std::vector<int64_t> kCalFwdUs = {3000, 5000, 4000, 6000, 3000, 5000, 4000, 6000};

torch::nn::Sequential calibration_net() {
  torch::manual_seed(3);
  torch::nn::Sequential net;
  for (int64_t us : kCalFwdUs) net->push_back(TimedLayer(kCalWidth, us, 2 * us));
  return net;
}

ModelExecutePlan calibration_plan() {
  ModelExecutePlan plan;
  plan.fwd_plan = {{0, 2}, {2, 4}, {4, 6}};
  plan.bwd_plan = {{6, 8}, {4, 6}, {2, 4}, {0, 2}};
  return plan;
}

// The simulator fed what `model` measured and the run's transfer sizes, on
// the CPU executor with the run's copy delay.
struct Calibrated {
  LayerCosts costs;
  SimOptions options;
};
Calibrated calibrated(const RoundPipe& model) {
  Calibrated c;
  c.costs = model.layer_costs();
  const int64_t act_bytes = kCalBatch / kCalMicrobatches * kCalWidth * 4;  // fp32 [2, 32] per microbatch
  c.costs.activation_bytes.assign(kCalFwdUs.size(), act_bytes);
  c.options.set_num_devices(kCalDevices)
      .set_num_microbatch(kCalMicrobatches)
      .set_run_kind(RunKind::kFused)
      .set_link_gbps(std::numeric_limits<double>::infinity())
      .set_input_bytes(act_bytes)
      .set_executor(SimExecutor::kCpu)
      .set_copy_delay_ms(kCalCopyDelayMs);
  return c;
}

TEST(Simulator, PredictsARealRunsIterationTimeWithinTenPercent) {
  // Fed the per-layer timings this run measured and its transfer sizes, the
  // simulator (CPU executor, the same copy delay) must predict the run's
  // iteration time within 10 %.
  testing::CopyDelay delay(static_cast<int64_t>(kCalCopyDelayMs * 1000));
  // One iteration alone: each call returns when it has ended.
  RoundPipe model(calibration_net(), RoundPipeOptions().set_max_devices(kCalDevices).set_overlap_iterations(false));
  const ModelExecutePlan plan = calibration_plan();
  const RunConfig cfg = RunConfig().num_microbatch(kCalMicrobatches).execute_plan(plan);
  const at::Tensor x = torch::randn({kCalBatch, kCalWidth}), y = torch::randn({kCalBatch, kCalWidth});
  double measured_ms = 1e300;  // the fastest iteration: the least disturbed by other processes
  for (int i = 0; i < 6; ++i) {
    const auto start = std::chrono::steady_clock::now();
    model.forward_backward({x}, make_kwargs(), y, mse(), false, cfg);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (i >= 2) measured_ms = std::min(measured_ms, ms);  // two warm-up iterations
  }

  Calibrated sim = calibrated(model);
  const double predicted_ms = simulate_roundpipe(sim.costs, plan, sim.options).single_iteration_ms;
  // The same costs on an accelerator's executor without copy delays, shown
  // for comparison: what the calibration adds.
  sim.options.set_executor(SimExecutor::kAccelerator).set_copy_delay_ms(0);
  const double accelerator_ms = simulate_roundpipe(sim.costs, plan, sim.options).single_iteration_ms;
  std::printf("calibration: measured %.2f ms per iteration, predicted %.2f ms (%+.2f %%); "
              "without the CPU executor and copy delay %.2f ms\n",
              measured_ms, predicted_ms, 100.0 * (predicted_ms / measured_ms - 1), accelerator_ms);
  EXPECT_NEAR(predicted_ms / measured_ms, 1.0, 0.10) << "measured " << measured_ms << " ms, predicted "
                                                       << predicted_ms << " ms";
}

TEST(Simulator, PredictsAnOverlappedRunsIterationTimeWithinTenPercent) {
  // As above, with iteration overlap and asynchronous steps: the simulator's
  // kAfterLosses lifecycle (the next call issued at the losses, each stage
  // upload after the previous call's last upload of its layers) against the
  // run's steady-state time per iteration.
  constexpr int64_t kWarmup = 3, kMeasured = 6;
  testing::CopyDelay delay(static_cast<int64_t>(kCalCopyDelayMs * 1000));
  RoundPipe model(calibration_net(), RoundPipeOptions().set_max_devices(kCalDevices));
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(1e-3));
  const ModelExecutePlan plan = calibration_plan();
  const RunConfig cfg = RunConfig().num_microbatch(kCalMicrobatches).execute_plan(plan);
  const at::Tensor x = torch::randn({kCalBatch, kCalWidth}), y = torch::randn({kCalBatch, kCalWidth});
  std::vector<std::chrono::steady_clock::time_point> returned;  // when each call's losses were known
  for (int i = 0; i < kWarmup + kMeasured + 1; ++i) {
    model.forward_backward({x}, make_kwargs(), y, mse(), false, cfg);
    returned.push_back(std::chrono::steady_clock::now());
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
  }
  model.synchronize();
  const double measured_ms =
      std::chrono::duration<double, std::milli>(returned[kWarmup + kMeasured] - returned[kWarmup]).count() / kMeasured;

  Calibrated sim = calibrated(model);
  sim.options.set_overlap(IterationOverlap::kAfterLosses).set_warmup_iterations(kWarmup).set_measured_iterations(kMeasured);
  const SimResult r = simulate_roundpipe(sim.costs, plan, sim.options);
  std::printf("overlapped calibration: measured %.2f ms per iteration, predicted %.2f ms (%+.2f %%); "
              "one iteration alone %.2f ms\n",
              measured_ms, r.iteration_ms, 100.0 * (r.iteration_ms / measured_ms - 1), r.single_iteration_ms);
  EXPECT_NEAR(r.iteration_ms / measured_ms, 1.0, 0.10) << "measured " << measured_ms << " ms, predicted "
                                                        << r.iteration_ms << " ms";
  EXPECT_LT(measured_ms, 0.95 * r.single_iteration_ms) << "the calls did not overlap";
}

}  // namespace
}  // namespace roundpipe
