// The compact configuration in the engine: bf16 optimizer copies get one bf16
// gradient per parameter (the sum of the calls, handed over without a copy),
// sums of several terms round stochastically and reproducibly, and results
// do not depend on the device count.
#include <gtest/gtest.h>

#include "engine/gradient_sums.h"
#include "models.h"

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

TEST(CompactGradients, FloatSumsAddExactlyAsBefore) {
  at::Tensor acc = at::full({5}, 1.0f);
  accumulate_gradient(acc, at::full({5}, 0.25, at::kBFloat16), 1, 1);
  EXPECT_TRUE(at::equal(acc, at::full({5}, 1.25f)));
}

// Six layers (the fixed plan's), dropout in the middle, built in bf16.
torch::nn::Sequential make_bf16_mlp() {
  torch::nn::Sequential net(torch::nn::Linear(32, 64), torch::nn::GELU(), torch::nn::Dropout(0.2),
                            torch::nn::Linear(64, 64), torch::nn::GELU(), torch::nn::Linear(64, 32));
  net->to(at::kBFloat16);
  return net;
}

LossFn mse_loss_fn() {
  return [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return (out.toTensor().to(at::kFloat) - y.toTensor()).square().mean();
  };
}

std::pair<at::Tensor, at::Tensor> batch() {
  return {torch::randn({8, 32}).to(at::kBFloat16), torch::randn({8, 32})};
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

// bf16 model and copies, two calls per step (their bf16 sums round
// stochastically), a plain SGD step on the copies, asynchronous.
Trajectory train_compact(int64_t devices) {
  torch::manual_seed(7);
  torch::nn::Sequential net = make_bf16_mlp();
  RoundPipe model(net, RoundPipeOptions().set_max_devices(devices).set_seed(1234).set_optim_dtype(at::kBFloat16));
  torch::manual_seed(8);
  Trajectory t;
  for (int step = 0; step < 3; ++step) {
    for (int call = 0; call < 2; ++call) {
      const auto [x, y] = batch();
      t.losses.push_back(model.forward_backward({x}, make_kwargs(), y, mse_loss_fn(), false, fixed_plan()).toTensor());
    }
    model.step([&model] {
      at::NoGradGuard no_grad;
      for (at::Tensor& p : model.optim_parameters()) {
        p.add_(p.grad(), -0.05);
        p.mutable_grad().reset();
      }
    });
  }
  model.synchronize();
  t.params = values_of(net->parameters());
  t.copies = values_of(model.optim_parameters());
  return t;
}

void expect_bitwise_equal(const Trajectory& a, const Trajectory& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_TRUE(torch::equal(a.losses[i], b.losses[i])) << what << " loss " << i;
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(torch::equal(a.params[i], b.params[i])) << what << " param " << i;
  for (size_t i = 0; i < a.copies.size(); ++i) EXPECT_TRUE(torch::equal(a.copies[i], b.copies[i])) << what << " copy " << i;
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

}  // namespace
}  // namespace testing
}  // namespace roundpipe
