// Results do not depend on how many devices run the jobs: bitwise, dropout
// included (random streams are keyed by seed, call, layer and microbatch).
#include <gtest/gtest.h>

#include <mutex>
#include <thread>

#include "copy_delay.h"
#include "models.h"

namespace roundpipe {
namespace testing {
namespace {

struct Trajectory {
  std::vector<at::Tensor> losses;
  std::vector<at::Tensor> params;
};

Trajectory train(int64_t devices, RecomputeGrain grain) {
  torch::manual_seed(7);
  torch::nn::Sequential net = make_transformer(/*dropout=*/0.2);
  RoundPipe model(net, RoundPipeOptions().set_max_devices(devices).set_seed(1234));
  RunConfig cfg = RunConfig().num_microbatch(4).recompute_grain(grain).execute_plan(
      ModelExecutePlan{{{0, 1}, {1, 3}}, {{3, 6}, {2, 3}, {1, 2}, {0, 1}}});
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return lm_loss(out.toTensor(), y.toTensor());
  };
  Trajectory t;
  for (int step = 0; step < 5; ++step) {
    at::Tensor ids = torch::randint(kVocab, {8, kSeq}), targets = torch::randint(kVocab, {8, kSeq});
    t.losses.push_back(model.forward_backward({ids}, make_kwargs(), targets, loss_fn, false, cfg).toTensor());
    model.synchronize();
    opt.step();
    opt.zero_grad();
  }
  t.params = values_of(net->parameters());
  return t;
}

void expect_bitwise_equal(const Trajectory& a, const Trajectory& b, const std::string& what) {
  expect_all_equal(a.losses, b.losses, what + " loss");
  expect_all_equal(a.params, b.params, what + " param");
}

TEST(DeviceCountInvariance, BitwiseIdenticalOnOneTwoAndFourDevicesWithDropout) {
  for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
    Trajectory one = train(1, grain);
    expect_bitwise_equal(one, train(2, grain), "cpu:2");
    expect_bitwise_equal(one, train(4, grain), "cpu:4");
  }
}

TEST(DeviceCountInvariance, BitwiseIdenticalWithDelayedCopies) {
  // Copies complete 200 us late and read as NaN until then: a read without
  // its fence would change the result.
  for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
    Trajectory prompt = train(1, grain);
    CopyDelay delay(200);
    expect_bitwise_equal(prompt, train(1, grain), "cpu:1, delayed copies");
    expect_bitwise_equal(prompt, train(3, grain), "cpu:3, delayed copies");
  }
}

// Records the thread of every reset(): a clone re-runs reset(), which draws
// from the global generator.
struct ResetThreadsImpl : torch::nn::Cloneable<ResetThreadsImpl> {
  struct Log {
    std::mutex mu;
    std::vector<std::thread::id> threads;
  };
  explicit ResetThreadsImpl(std::shared_ptr<Log> log) : log(std::move(log)) { reset(); }
  void reset() override {
    {
      std::lock_guard<std::mutex> lock(log->mu);
      log->threads.push_back(std::this_thread::get_id());
    }
    linear = register_module("linear", torch::nn::Linear(4, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return linear(x); }
  std::shared_ptr<Log> log;
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(ResetThreads);

TEST(DeviceCountInvariance, ReplicasAreClonedOnTheThreadThatMakesTheModel) {
  // A replica cloned on a device worker would save, draw from and restore
  // the global generator while the caller draws from it during a call (with
  // iteration overlap): the caller's random numbers would depend on timing.
  auto log = std::make_shared<ResetThreadsImpl::Log>();
  auto net = torch::nn::Sequential(ResetThreads(log), torch::nn::Tanh(), ResetThreads(log), torch::nn::Linear(4, 1));
  RoundPipe model(net, RoundPipeOptions().set_max_devices(3).set_seed(2));
  // Three jobs per call over three devices: both layers run on devices
  // other than the first.
  const RunConfig cfg =
      RunConfig().num_microbatch(2).execute_plan(ModelExecutePlan{{{0, 2}}, {{2, 4}, {0, 2}}});
  for (int call = 0; call < 3; ++call) {
    model.forward_backward({torch::randn({4, 4})}, make_kwargs(), torch::randn({4, 1}), mse_loss_fn(), false, cfg);
    model.synchronize();
  }
  std::lock_guard<std::mutex> lock(log->mu);
  EXPECT_EQ(log->threads.size(), 2u * (1 + 3));  // two layers: the original and three replicas each
  for (const auto& id : log->threads) EXPECT_EQ(id, std::this_thread::get_id());
}

TEST(DeviceCountInvariance, DropoutIsActiveAndRecomputationRepeatsIt) {
  // With dropout on, two different seeds give different losses; the same
  // seed gives the same loss (the recomputed masks match the forward's,
  // otherwise gradients would differ from the equivalence tests' pattern).
  torch::manual_seed(8);
  torch::nn::Sequential net = make_transformer(0.5);
  torch::nn::Sequential copy = copy_transformer(net, 0.5);
  RoundPipe a(net, RoundPipeOptions().set_seed(1));
  RoundPipe b(copy, RoundPipeOptions().set_seed(2));
  at::Tensor ids = torch::randint(kVocab, {4, kSeq}), targets = torch::randint(kVocab, {4, kSeq});
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return lm_loss(out.toTensor(), y.toTensor());
  };
  at::Tensor la = a.forward_backward({ids}, make_kwargs(), targets, loss_fn).toTensor();
  at::Tensor lb = b.forward_backward({ids}, make_kwargs(), targets, loss_fn).toTensor();
  EXPECT_FALSE(torch::equal(la, lb));
}

TEST(DeviceCountInvariance, RecomputedDropoutMasksMatchTheForward) {
  // Plan A runs everything in the fused stage (no recomputation); plan B puts
  // the dropout layer in a recomputed backward stage on another device. Same
  // seed and call, so the same keyed mask: gradients must agree, which they
  // only do if recomputation replays the forward's mask.
  auto grads_with = [](const ModelExecutePlan& plan) {
    torch::manual_seed(9);
    torch::nn::Sequential net(torch::nn::Linear(8, 8), torch::nn::Dropout(0.5), torch::nn::Linear(8, 1));
    RoundPipe model(net, RoundPipeOptions().set_max_devices(2).set_seed(5));
    at::Tensor x = torch::randn({1, 8});  // one sample: a dropped unit zeroes a whole row below
    LossFn loss_fn = [](const c10::IValue& out, const c10::IValue&) -> c10::IValue { return out.toTensor().sum(); };
    model.forward_backward({x}, make_kwargs(), c10::IValue(), loss_fn, false,
                           RunConfig().num_microbatch(1).execute_plan(plan));
    model.synchronize();
    return grads_of(net->parameters());
  };
  auto fused_only = grads_with(ModelExecutePlan{{}, {{0, 3}}});
  auto recomputed = grads_with(ModelExecutePlan{{{0, 2}}, {{2, 3}, {1, 2}, {0, 1}}});
  expect_all_close(fused_only, recomputed, 1e-6, "gradients through a recomputed dropout");
  // And dropout really drops: some first-layer weight gradients are zero rows.
  EXPECT_GT((fused_only[0].abs().sum(1) == 0).sum().item<int64_t>(), 0);
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
