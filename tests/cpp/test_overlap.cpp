// Iteration overlap (the default; RoundPipeOptions::overlap_iterations):
// forward_backward returns at its losses with its backward stages in flight. Results must be bitwise those
// without overlap, on any device count and with delayed copies; the next
// call must start before the previous one ends; a failure of the backward
// stages is raised once, by a later call, and applies nothing.
#include <gtest/gtest.h>
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "copy_delay.h"
#include "engine/trace_recorder.h"
#include "models.h"

namespace roundpipe {
namespace {

using testing::make_mlp;

// make_mlp's 9 layers: 2 forward stages, the fused stage, 2 backward stages.
ModelExecutePlan mlp_plan() {
  ModelExecutePlan plan;
  plan.fwd_plan = {{0, 3}, {3, 6}};
  plan.bwd_plan = {{6, 9}, {3, 6}, {0, 3}};
  return plan;
}

struct Trained {
  std::vector<double> losses;
  std::vector<at::Tensor> params;
};

// `iterations` asynchronous SGD steps (momentum) over fixed batches; with
// `scribble`, the caller overwrites each batch as soon as its call returns.
Trained train(bool overlap, int64_t devices, int iterations = 5, bool scribble = false) {
  torch::manual_seed(7);
  RoundPipe model(make_mlp(), RoundPipeOptions().set_max_devices(devices).set_seed(11).set_overlap_iterations(overlap));
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const RunConfig cfg = RunConfig().num_microbatch(3).execute_plan(mlp_plan());
  Trained out;
  for (int i = 0; i < iterations; ++i) {
    torch::manual_seed(100 + i);
    at::Tensor x = torch::randn({6, 16}), y = torch::randn({6, 4});
    c10::IValue loss = model.forward_backward({x}, make_kwargs(), y, testing::mse_loss_fn(), false, cfg);
    if (scribble) x.fill_(std::numeric_limits<float>::quiet_NaN());
    out.losses.push_back(loss.toTensor().item<double>());
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
  }
  model.synchronize();
  for (const at::Tensor& p : model.parameters()) out.params.push_back(p.detach().clone());
  return out;
}

void expect_bitwise_equal(const Trained& a, const Trained& b) {
  EXPECT_EQ(a.losses, b.losses);
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(torch::equal(a.params[i], b.params[i])) << "parameter " << i;
}

TEST(IterationOverlap, BitwiseTheResultsWithoutOverlapOnEveryDeviceCount) {
  const Trained reference = train(/*overlap=*/false, 2);
  for (int64_t devices : {1, 2, 3}) {
    SCOPED_TRACE("devices " + std::to_string(devices));
    expect_bitwise_equal(train(/*overlap=*/true, devices), reference);
  }
}

TEST(IterationOverlap, BitwiseTheResultsWithoutOverlapWithDelayedCopies) {
  // Copies 500 us late (NaN until then): a step's write of a layer that the
  // call in flight still uploads, or a read before its fence, would show.
  const Trained reference = train(/*overlap=*/false, 3);
  testing::CopyDelay delay(500);
  expect_bitwise_equal(train(/*overlap=*/true, 3), reference);
}

TEST(IterationOverlap, TheCallerMayReuseItsInputsAsSoonAsTheCallReturns) {
  // The backward stages still running read the call's own copy of the
  // inputs: slow layers keep them running long after the call returned.
  const Trained reference = train(/*overlap=*/false, 3);
  auto devices = testing::slow_cpu_devices();
  for (int d = 0; d < 3; ++d) devices.at(d)->set_layer_delay(std::chrono::milliseconds(2));
  const Trained scribbled = train(/*overlap=*/true, 3, 5, /*scribble=*/true);
  for (int d = 0; d < 3; ++d) devices.at(d)->set_layer_delay(std::chrono::microseconds(0));
  expect_bitwise_equal(scribbled, reference);
}

TEST(IterationOverlap, TheNextCallStartsBeforeThePreviousOneEnds) {
  auto devices = testing::slow_cpu_devices();
  for (int d = 0; d < 3; ++d) devices.at(d)->set_layer_delay(std::chrono::milliseconds(2));
  torch::manual_seed(1);
  RoundPipe model(make_mlp(), RoundPipeOptions().set_max_devices(3).set_name("overlapped"));
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.01));
  const RunConfig cfg = RunConfig().num_microbatch(4).execute_plan(mlp_plan());
  const std::string path = ::testing::TempDir() + "/overlap_trace.json";
  start_trace(path);
  for (int i = 0; i < 4; ++i) {
    model.forward_backward({torch::randn({8, 16})}, make_kwargs(), torch::randn({8, 4}), testing::mse_loss_fn(),
                           false, cfg);
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
  }
  model.synchronize();
  std::vector<TraceEvent> events = Tracer::instance().events();
  stop_trace();
  std::remove(path.c_str());
  for (int d = 0; d < 3; ++d) devices.at(d)->set_layer_delay(std::chrono::microseconds(0));
  // Per call of this model: its first compute's start and last compute's end.
  std::map<int64_t, std::pair<double, double>> span;
  for (const TraceEvent& e : events) {
    if (e.model != "overlapped" || e.kind != "compute") continue;
    auto [it, fresh] = span.emplace(e.call, std::make_pair(e.start_us, e.start_us + e.dur_us));
    it->second.first = std::min(it->second.first, e.start_us);
    it->second.second = std::max(it->second.second, e.start_us + e.dur_us);
  }
  ASSERT_EQ(span.size(), 4u);
  int overlapped = 0;
  for (const auto& [call, s] : span) std::printf("call %lld: %.1f .. %.1f ms\n", (long long)call, s.first / 1e3, s.second / 1e3);
  for (auto it = std::next(span.begin()); it != span.end(); ++it) {
    overlapped += it->second.first < std::prev(it)->second.second;
  }
  EXPECT_EQ(overlapped, 3) << "every call after the first starts while the one before still computes";
}

// Layer 0 (the last backward stage) whose backward fails on its nth run.
std::atomic<int64_t> backward_runs{0};
std::atomic<int64_t> fail_backward_run{-1};

struct PlantedBackward : torch::autograd::Function<PlantedBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    if (++backward_runs == fail_backward_run.load()) throw std::runtime_error("planted backward failure");
    return {grads.at(0)};
  }
};

struct PlantedImpl : torch::nn::Cloneable<PlantedImpl> {
  PlantedImpl() { reset(); }
  void reset() override { linear = register_module("linear", torch::nn::Linear(16, 16)); }
  at::Tensor forward(const at::Tensor& x) { return PlantedBackward::apply(linear(x)); }
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(Planted);

torch::nn::Sequential planted_mlp() {
  torch::nn::Sequential seq = make_mlp();
  torch::nn::Sequential out;
  out->push_back(Planted());
  for (auto it = std::next(seq->begin()); it != seq->end(); ++it) out->push_back(*it);
  return out;
}

TEST(IterationOverlap, ABackwardFailureIsRaisedOnceByALaterCallAndAppliesNothing) {
  // A: iteration 2's backward fails in its last stage (after its losses
  // may be known). B: the same without iteration 2. Exactly one call of A
  // raises the failure; afterwards both train to the same parameters.
  const RunConfig cfg = RunConfig().num_microbatch(3).execute_plan(mlp_plan());
  auto run = [&](bool with_failure) {
      torch::manual_seed(3);
    RoundPipe model(planted_mlp(), RoundPipeOptions().set_max_devices(3).set_seed(5));
    torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.05));
    auto step = [&] {
      model.step([&] {
        opt.step();
        opt.zero_grad();
      });
    };
    auto batch = [](int i) {
      torch::manual_seed(50 + i);
      return std::make_pair(torch::randn({6, 16}), torch::randn({6, 4}));
    };
    int errors = 0;
    auto expect_planted = [&](auto f) {
      try {
        f();
      } catch (const std::exception& e) {
        ++errors;
        EXPECT_NE(std::string(e.what()).find("planted backward failure"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("backward stage"), std::string::npos) << e.what();
      }
    };
    auto [x1, y1] = batch(1);
    model.forward_backward({x1}, make_kwargs(), y1, testing::mse_loss_fn(), false, cfg);
    step();
    model.synchronize();  // iteration 1's backward runs are over before the counter restarts
    if (with_failure) {
      backward_runs = 0;
      fail_backward_run = 1;  // iteration 2's first microbatch
      auto [x2, y2] = batch(2);
      expect_planted([&] { model.forward_backward({x2}, make_kwargs(), y2, testing::mse_loss_fn(), false, cfg); });
    }
    expect_planted([&] { step(); });
    expect_planted([&] { model.synchronize(); });
    fail_backward_run = -1;
    EXPECT_EQ(errors, with_failure ? 1 : 0);
    auto [x3, y3] = batch(3);
    model.forward_backward({x3}, make_kwargs(), y3, testing::mse_loss_fn(), false, cfg);
    step();
    model.synchronize();
    std::vector<at::Tensor> params;
    for (const at::Tensor& p : model.parameters()) params.push_back(p.detach().clone());
    return params;
  };
  const auto failed = run(true), clean = run(false);
  ASSERT_EQ(failed.size(), clean.size());
  for (size_t i = 0; i < failed.size(); ++i) EXPECT_TRUE(torch::equal(failed[i], clean[i])) << "parameter " << i;
}

TEST(IterationOverlap, DestroyingAModelWithBackwardStagesInFlightFinishesThem) {
  auto devices = testing::slow_cpu_devices();
  for (int d = 0; d < 2; ++d) devices.at(d)->set_layer_delay(std::chrono::milliseconds(3));
  {
    RoundPipe model(make_mlp(), RoundPipeOptions().set_max_devices(2));
    model.forward_backward({torch::randn({6, 16})}, make_kwargs(), torch::randn({6, 4}), testing::mse_loss_fn(),
                           false, RunConfig().num_microbatch(3).execute_plan(mlp_plan()));
  }  // destroyed with its backward stages still running
  for (int d = 0; d < 2; ++d) devices.at(d)->set_layer_delay(std::chrono::microseconds(0));
  // The devices are free and work for the next model.
  RoundPipe next(make_mlp(), RoundPipeOptions().set_max_devices(2));
  EXPECT_NO_THROW(next.forward_backward({torch::randn({6, 16})}, make_kwargs(), torch::randn({6, 4}),
                                        testing::mse_loss_fn()));
}

}  // namespace
}  // namespace roundpipe
