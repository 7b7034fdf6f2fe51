// The compact configuration in the engine: bf16 optimizer copies get one bf16
// gradient per parameter (the sum of the calls, handed over without a copy),
// sums of several terms round stochastically and reproducibly, and training
// with AdamW's 8-bit states gives the same bits on every device count and
// after a checkpoint resume.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>

#include "engine/gradient_sums.h"
#include "roundpipe/optim/adam.h"
#include "models.h"
#include "stochastic_rounding_reference.h"

namespace roundpipe {
namespace testing {
namespace {

TEST(CompactGradients, BfloatSumsKeepTermsBelowHalfAnUlpOnAverage) {
  // 1 + 100 * 1e-3: every term is under half a bf16 ulp of 1 (2^-8), so
  // round-to-nearest would leave every element at 1.
  const int64_t n = 100000;
  at::Tensor acc = at::ones({n}, at::kBFloat16);
  at::Tensor nearest = acc.clone();
  const at::Tensor term = at::full({n}, 1e-3, at::kFloat);
  for (uint64_t k = 0; k < 100; ++k) {
    accumulate_gradient(acc, term, /*sr_seed=*/3, /*sr_step=*/k);
    nearest.add_(term.to(at::kBFloat16));
  }
  EXPECT_TRUE(at::equal(nearest, at::ones({n}, at::kBFloat16))) << "the case round-to-nearest loses";
  EXPECT_NEAR(acc.to(at::kFloat).mean().item<double>(), 1.1, 0.002);
}

TEST(CompactGradients, BfloatSumsAreTheDocumentedStochasticRoundingBitwise) {
  torch::manual_seed(1);
  const at::Tensor start = at::randn({1000}).to(at::kBFloat16);
  const at::Tensor term = at::randn({1000}).to(at::kBFloat16) * 0.01;
  at::Tensor acc = start.clone();
  accumulate_gradient(acc, term, /*sr_seed=*/17, /*sr_step=*/(uint64_t{5} << 16) + 2);
  const at::Tensor exact = start.to(at::kFloat) + term.to(at::kFloat);  // the fp32 sum the kernel rounds
  at::Tensor expected = at::empty({1000}, at::kBFloat16);
  for (int64_t j = 0; j < 1000; ++j) {
    static_cast<uint16_t*>(expected.data_ptr())[j] = reference_bf16_stochastic(
        exact.data_ptr<float>()[j], 17, (uint64_t{5} << 16) + 2, static_cast<uint64_t>(j));
  }
  EXPECT_TRUE(at::equal(acc, expected));
}

TEST(CompactGradients, BfloatSumsAreReproducibleAndSeededPerUse) {
  torch::manual_seed(0);
  const at::Tensor start = at::randn({4099}).to(at::kBFloat16);
  const at::Tensor term = at::randn({4099}) * 1e-3;
  auto sum = [&](uint64_t seed, uint64_t step) {
    at::Tensor acc = start.clone();
    accumulate_gradient(acc, term, seed, step);
    return acc;
  };
  EXPECT_TRUE(at::equal(sum(1, 2), sum(1, 2)));
  EXPECT_FALSE(at::equal(sum(1, 2), sum(1, 3))) << "the step reseeds";
  EXPECT_FALSE(at::equal(sum(1, 2), sum(2, 2))) << "the parameter reseeds";
  // Each result is within one bf16 ulp (2^-7 relative) of the exact sum.
  const at::Tensor exact = start.to(at::kFloat) + term;
  const at::Tensor got = sum(1, 2).to(at::kFloat);
  EXPECT_TRUE(((got - exact).abs() <= exact.abs() / 128).all().item<bool>());
}

TEST(CompactGradients, ANonContiguousBfloatSumIsMadeContiguous) {
  at::Tensor acc = at::ones({4, 3}, at::kBFloat16).t();
  ASSERT_FALSE(acc.is_contiguous());
  accumulate_gradient(acc, at::full({3, 4}, 0.5), 1, 1);
  EXPECT_TRUE(acc.is_contiguous());
  EXPECT_TRUE(at::equal(acc, at::full({3, 4}, 1.5, at::kBFloat16)));  // exact: no rounding
}

TEST(CompactGradients, FloatSumsAddExactlyAsBefore) {
  at::Tensor acc = at::full({5}, 1.0f);
  accumulate_gradient(acc, at::full({5}, 0.25, at::kBFloat16), 1, 1);
  EXPECT_TRUE(at::equal(acc, at::full({5}, 1.25f)));
}

// Six layers (the fixed plan's), dropout in the middle, built in bf16; the
// weights are large enough for 8-bit Adam states (optim::kMinBlockwise8Numel).
torch::nn::Sequential make_bf16_mlp() {
  torch::nn::Sequential net(torch::nn::Linear(64, 128), torch::nn::GELU(), torch::nn::Dropout(0.2),
                            torch::nn::Linear(128, 128), torch::nn::GELU(), torch::nn::Linear(128, 64));
  net->to(at::kBFloat16);
  return net;
}

LossFn mse_loss_fn() {
  return [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return (out.toTensor().to(at::kFloat) - y.toTensor()).square().mean();
  };
}

std::pair<at::Tensor, at::Tensor> batch() {
  return {torch::randn({8, 64}).to(at::kBFloat16), torch::randn({8, 64})};
}

RunConfig fixed_plan() {
  return RunConfig().num_microbatch(4).execute_plan(
      ModelExecutePlan{{{0, 1}, {1, 3}}, {{3, 6}, {2, 3}, {1, 2}, {0, 1}}});
}

TEST(CompactEngine, BfloatCopiesGetTheCallsGradientInBfloat) {
  // One call, then a step: each copy's .grad is the call's gradient, the same
  // values synchronize() gives the model's bf16 parameters.
  auto run = [](bool step) {
    torch::manual_seed(5);
    torch::nn::Sequential net = make_bf16_mlp();
    RoundPipe model(net, RoundPipeOptions().set_max_devices(2).set_seed(9).set_optim_dtype(at::kBFloat16));
    torch::manual_seed(6);
    const auto [x, y] = batch();
    model.forward_backward({x}, make_kwargs(), y, mse_loss_fn(), false, fixed_plan());
    std::vector<at::Tensor> grads;
    if (step) {
      model.step(
          [&] {
            for (const at::Tensor& p : model.optim_parameters()) {
              EXPECT_EQ(p.scalar_type(), at::kBFloat16);
              ASSERT_TRUE(p.grad().defined());
              EXPECT_EQ(p.grad().scalar_type(), at::kBFloat16) << "one gradient, in the copy's dtype";
              EXPECT_EQ(p.grad().storage().nbytes(), p.grad().nbytes()) << "memory of its own";
              grads.push_back(p.grad().clone());
            }
          },
          /*is_async=*/false);
    } else {
      model.synchronize();
      for (const at::Tensor& p : net->parameters()) grads.push_back(p.grad().clone());
    }
    return grads;
  };
  const std::vector<at::Tensor> stepped = run(true), synchronized = run(false);
  ASSERT_EQ(stepped.size(), synchronized.size());
  for (size_t i = 0; i < stepped.size(); ++i) EXPECT_TRUE(at::equal(stepped[i], synchronized[i])) << "param " << i;
}

struct Trajectory {
  std::vector<at::Tensor> losses, params, copies;
};

constexpr int kSteps = 4, kCallsPerStep = 2;

// The compact configuration: bf16 model and copies, AdamW with 8-bit states,
// two calls per step (their bf16 sums round stochastically), asynchronous
// steps.
struct CompactTrainer {
  torch::nn::Sequential net;
  RoundPipe model;
  optim::AdamW opt;

  CompactTrainer(int64_t devices, uint64_t init)
      : net((torch::manual_seed(init), make_bf16_mlp())),
        model(net, RoundPipeOptions().set_max_devices(devices).set_seed(1000 + init).set_optim_dtype(at::kBFloat16)),
        opt(model.optim_parameters(), optim::AdamWOptions(1e-2).state_dtype(optim::StateDtype::kBlockwise8)) {}

  // Call c (0-based) of step k (1-based), on data fixed by (k, c).
  at::Tensor call(int k, int c) {
    torch::manual_seed(100 * k + c);
    const auto [x, y] = batch();
    return model.forward_backward({x}, make_kwargs(), y, mse_loss_fn(), false, fixed_plan()).toTensor();
  }
  void step() {
    model.step([this] {
      opt.step();
      opt.zero_grad();
    });
  }
  void finish(Trajectory& t) {
    model.synchronize();
    t.params = values_of(net->parameters());
    t.copies = values_of(model.optim_parameters());
  }
};

Trajectory train_compact(int64_t devices) {
  CompactTrainer trainer(devices, /*init=*/7);
  Trajectory t;
  for (int k = 1; k <= kSteps; ++k) {
    for (int c = 0; c < kCallsPerStep; ++c) t.losses.push_back(trainer.call(k, c));
    trainer.step();
  }
  trainer.finish(t);
  return t;
}

void expect_bitwise_equal(const Trajectory& a, const Trajectory& b, const std::string& what) {
  expect_all_equal(a.losses, b.losses, what + " loss");
  expect_all_equal(a.params, b.params, what + " param");
  expect_all_equal(a.copies, b.copies, what + " copy");
}

TEST(CompactEngine, BitwiseIdenticalOnOneTwoAndFourDevices) {
  const Trajectory one = train_compact(1);
  expect_bitwise_equal(one, train_compact(2), "cpu:2");
  expect_bitwise_equal(one, train_compact(4), "cpu:4");
  // The steps changed the model (the comparison is not between untouched copies).
  torch::manual_seed(7);
  torch::nn::Sequential fresh = make_bf16_mlp();
  EXPECT_FALSE(torch::equal(fresh->parameters()[0], one.params[0]));
}

TEST(CompactEngine, CheckpointBetweenTwoCallsOfAStepResumesBitwise) {
  // Saved after the first call of step 3: its bf16 gradient sums are pending
  // and the 8-bit states hold two steps. Resumed in a model with other
  // weights and seeds on another device count.
  const std::string path = ::testing::TempDir() + "compact_engine_" + std::to_string(::getpid()) + ".ckpt";
  const Trajectory full = train_compact(2);
  {
    CompactTrainer trainer(2, /*init=*/7);
    for (int k = 1; k <= 3; ++k) {
      trainer.call(k, 0);
      if (k == 3) break;
      trainer.call(k, 1);
      trainer.step();
    }
    CheckpointState state;
    state.optimizer = &trainer.opt;
    state.step = 2;
    save_checkpoint(path, trainer.model, state);
  }
  CompactTrainer resumed(3, /*init=*/8);
  CheckpointState state;
  state.optimizer = &resumed.opt;
  load_checkpoint(path, resumed.model, state);
  std::remove(path.c_str());
  EXPECT_EQ(state.step, 2);
  Trajectory t;
  for (int k = 3; k <= kSteps; ++k) {
    for (int c = k == 3 ? 1 : 0; c < kCallsPerStep; ++c) {
      const at::Tensor loss = resumed.call(k, c);
      EXPECT_TRUE(torch::equal(loss, full.losses[(k - 1) * kCallsPerStep + c])) << "step " << k << " call " << c;
    }
    resumed.step();
  }
  resumed.finish(t);
  for (const at::Tensor& copy : t.copies) EXPECT_EQ(copy.scalar_type(), at::kBFloat16);
  t.losses = full.losses;  // compared above
  expect_bitwise_equal(full, t, "resumed");
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
