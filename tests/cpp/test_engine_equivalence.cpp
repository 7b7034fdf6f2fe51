// RoundPipe against plain libtorch doing the same math: losses, every
// gradient, every parameter after several optimizer steps.
#include <gtest/gtest.h>

#include "copy_delay.h"
#include "models.h"

namespace roundpipe {
namespace testing {
namespace {

struct Case {
  int64_t microbatches;
  int64_t devices;
  RecomputeGrain grain;
  bool fused;  // forward_backward, else forward() + loss.backward()
};

std::string name_of(const Case& c) {
  return "M" + std::to_string(c.microbatches) + "_D" + std::to_string(c.devices) +
         (c.grain == RecomputeGrain::kStage ? "_stage" : "_layer") + (c.fused ? "_fused" : "_fwdbwd");
}

// Readable test names in gtest and ctest output.
void PrintTo(const Case& c, std::ostream* os) { *os << name_of(c); }

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (int64_t m : {1, 3, 5})
    for (int64_t d : {1, 2, 3})
      for (auto g : {RecomputeGrain::kStage, RecomputeGrain::kLayer})
        for (bool fused : {true, false}) out.push_back({m, d, g, fused});
  return out;
}

// Multi-layer stages so both recompute grains differ, and stage boundaries
// that differ between the forward and backward plans.
ModelExecutePlan mlp_plan(bool fused) {
  // 9 layers: Linear,Tanh x4, Linear.
  if (fused) return {{{0, 3}, {3, 6}}, {{6, 9}, {4, 6}, {1, 4}, {0, 1}}};
  return {{{0, 3}, {3, 6}, {6, 9}}, {{7, 9}, {4, 7}, {1, 4}, {0, 1}}};
}

class MlpEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(MlpEquivalence, LossGradientsAndParametersMatchPlainLibtorch) {
  const Case c = GetParam();
  torch::manual_seed(1);
  torch::nn::Sequential net = make_mlp();
  torch::nn::Sequential ref = copy_of(net);
  RoundPipe model(net, RoundPipeOptions().set_max_devices(c.devices).set_name("mlp"));
  RunConfig cfg = RunConfig().num_microbatch(c.microbatches).recompute_grain(c.grain).execute_plan(mlp_plan(c.fused));
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  const int64_t batch = 7;  // uneven split for M = 3 and 5
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return torch::mse_loss(out.toTensor(), y.toTensor());
  };

  for (int step = 0; step < 5; ++step) {
    at::Tensor x = torch::randn({batch, 16}), y = torch::randn({batch, 4});
    // Reference: the loop of RoundPipe::forward_backward (fused) or one full-batch backward.
    double ref_loss = 0;
    if (c.fused) {
      auto xs = x.tensor_split(c.microbatches), ys = y.tensor_split(c.microbatches);
      for (int64_t m = 0; m < c.microbatches; ++m) {
        at::Tensor l = torch::mse_loss(ref->forward(xs[m]), ys[m]);
        l.backward();
        ref_loss += l.item<double>();
      }
    } else {
      at::Tensor l = torch::mse_loss(ref->forward(x), y);
      l.backward();
      ref_loss = l.item<double>();
    }
    double loss;
    if (c.fused) {
      loss = model.forward_backward({x}, make_kwargs(), y, loss_fn, false, cfg).toTensor().item<double>();
    } else {
      at::Tensor out = model.forward(x, cfg);
      at::Tensor l = torch::mse_loss(out, y);
      l.backward();
      loss = l.item<double>();
    }
    EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss)) << "step " << step;
    model.synchronize();
    expect_all_close(grads_of(net->parameters()), grads_of(ref->parameters()), 1e-5,
                     "gradients at step " + std::to_string(step));
    opt.step();
    opt.zero_grad();
    ref_opt.step();
    ref_opt.zero_grad();
  }
  expect_all_close(values_of(net->parameters()), values_of(ref->parameters()), 1e-5, "parameters");
}

INSTANTIATE_TEST_SUITE_P(Grid, MlpEquivalence, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return name_of(info.param); });

// Embed | Block x4 | Head: a tuple between layers, a buffer updated in
// forward, the embedding tied to the head across stages, `scale` tied inside
// a stage (blocks 1 and 2).
ModelExecutePlan transformer_plan(bool fused) {
  if (fused) return {{{0, 2}, {2, 4}}, {{4, 6}, {3, 4}, {1, 3}, {0, 1}}};
  return {{{0, 2}, {2, 4}, {4, 6}}, {{4, 6}, {3, 4}, {1, 3}, {0, 1}}};
}

class TransformerEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(TransformerEquivalence, TupleLayersBuffersAndTiedParametersMatchPlainLibtorch) {
  const Case c = GetParam();
  torch::manual_seed(2);
  torch::nn::Sequential net = make_transformer();
  torch::nn::Sequential ref = copy_transformer(net);
  RoundPipe model(net, RoundPipeOptions().set_max_devices(c.devices).set_name("tiny-lm"));
  RunConfig cfg =
      RunConfig().num_microbatch(c.microbatches).recompute_grain(c.grain).execute_plan(transformer_plan(c.fused));
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05));
  const int64_t batch = 5;
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return lm_loss(out.toTensor(), y.toTensor());
  };
  for (int step = 0; step < 5; ++step) {
    at::Tensor ids = torch::randint(kVocab, {batch, kSeq}), targets = torch::randint(kVocab, {batch, kSeq});
    double ref_loss = 0;
    if (c.fused) {
      auto xs = ids.tensor_split(c.microbatches), ys = targets.tensor_split(c.microbatches);
      for (int64_t m = 0; m < c.microbatches; ++m) {
        at::Tensor l = lm_loss(run_plain(ref, {xs[m]}).toTensor(), ys[m]);
        l.backward();
        ref_loss += l.item<double>();
      }
    } else {
      // forward() runs microbatches separately: the buffer sees them one by one.
      auto xs = ids.tensor_split(c.microbatches);
      std::vector<at::Tensor> outs;
      for (int64_t m = 0; m < c.microbatches; ++m) outs.push_back(run_plain(ref, {xs[m]}).toTensor());
      at::Tensor l = lm_loss(torch::cat(outs), targets);
      l.backward();
      ref_loss = l.item<double>();
    }
    double loss;
    if (c.fused) {
      loss = model.forward_backward({ids}, make_kwargs(), targets, loss_fn, false, cfg).toTensor().item<double>();
    } else {
      at::Tensor l = lm_loss(model.forward({ids}, make_kwargs(), cfg).toTensor(), targets);
      l.backward();
      loss = l.item<double>();
    }
    EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss)) << "step " << step;
    model.synchronize();
    expect_all_close(grads_of(net->parameters()), grads_of(ref->parameters()), 1e-5,
                     "gradients at step " + std::to_string(step));
    opt.step();
    opt.zero_grad();
    ref_opt.step();
    ref_opt.zero_grad();
  }
  expect_all_close(values_of(net->parameters()), values_of(ref->parameters()), 1e-5, "parameters");
  expect_all_close(values_of(net->buffers()), values_of(ref->buffers()), 1e-5, "buffers");
}

INSTANTIATE_TEST_SUITE_P(Grid, TransformerEquivalence, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return name_of(info.param); });

TEST(Equivalence, GradientsAccumulateOverThreeCallsBeforeOneStep) {
  torch::manual_seed(3);
  torch::nn::Sequential net = make_mlp();
  torch::nn::Sequential ref = copy_of(net);
  RoundPipe model(net, RoundPipeOptions().set_max_devices(2));
  RunConfig cfg = RunConfig().num_microbatch(3).execute_plan(mlp_plan(true));
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return torch::mse_loss(out.toTensor(), y.toTensor());
  };
  for (int call = 0; call < 3; ++call) {
    at::Tensor x = torch::randn({6, 16}), y = torch::randn({6, 4});
    model.forward_backward({x}, make_kwargs(), y, loss_fn, false, cfg);
    auto xs = x.tensor_split(3), ys = y.tensor_split(3);
    for (int m = 0; m < 3; ++m) torch::mse_loss(ref->forward(xs[m]), ys[m]).backward();
  }
  model.synchronize();
  expect_all_close(grads_of(net->parameters()), grads_of(ref->parameters()), 1e-5, "accumulated gradients");
}

TEST(Equivalence, InputThatRequiresGradGetsItsGradAndOutputsAreReturned) {
  torch::manual_seed(4);
  torch::nn::Sequential net = make_mlp();
  torch::nn::Sequential ref = copy_of(net);
  RoundPipe model(net, RoundPipeOptions().set_max_devices(3));
  at::Tensor x = torch::randn({5, 16}).requires_grad_(), xr = x.detach().clone().requires_grad_();
  at::Tensor y = torch::randn({5, 4});
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return torch::mse_loss(out.toTensor(), y.toTensor(), at::Reduction::Sum);
  };
  auto result = model.forward_backward({x}, make_kwargs(), y, loss_fn, true, RunConfig().num_microbatch(2));
  const auto& pair = result.toTupleRef().elements();
  at::Tensor out = ref->forward(xr);
  torch::mse_loss(out, y, at::Reduction::Sum).backward();
  EXPECT_TRUE(torch::allclose(pair[1].toTensor(), out.detach(), 1e-5, 1e-7));
  EXPECT_FALSE(pair[0].toTensor().requires_grad());
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(torch::allclose(x.grad(), xr.grad(), 1e-5, 1e-7));
}

TEST(Equivalence, ForwardWithoutGradMatchesAndBuildsNoGraph) {
  torch::manual_seed(5);
  torch::nn::Sequential net = make_mlp();
  torch::nn::Sequential ref = copy_of(net);
  RoundPipe model(net, RoundPipeOptions().set_max_devices(2));
  at::Tensor x = torch::randn({9, 16});
  torch::NoGradGuard no_grad;
  at::Tensor out = model.forward(x, RunConfig().num_microbatch(4));
  EXPECT_FALSE(out.requires_grad());
  EXPECT_TRUE(torch::allclose(out, ref->forward(x), 1e-5, 1e-7));
}

// Adds one to its input in place, then squares: a layer recomputed from an
// input it already changed, or a saved input read after the change, gives
// other outputs and other gradients.
struct ShiftInPlaceImpl : torch::nn::Cloneable<ShiftInPlaceImpl> {
  void reset() override {}
  at::Tensor forward(at::Tensor x) {
    x.add_(1.0);
    return x * x;
  }
};
TORCH_MODULE(ShiftInPlace);

TEST(Equivalence, LayersThatChangeTheirInputInPlaceMatchPlainLibtorch) {
  // Stages start at the in-place layers (1, 3, 5) in forward, fused and
  // backward stages; the copies of their inputs are late, as a GPU's are.
  CopyDelay delay(300);
  auto relu = [] { return torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)); };
  for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
    for (bool fused : {true, false}) {
      SCOPED_TRACE(std::string(grain == RecomputeGrain::kStage ? "stage" : "layer") + (fused ? " fused" : " fwd+bwd"));
      torch::manual_seed(6);
      torch::nn::Sequential net(torch::nn::Linear(16, 16), ShiftInPlace(), torch::nn::Linear(16, 16), ShiftInPlace(),
                                torch::nn::Linear(16, 16), relu(), torch::nn::Linear(16, 4));
      torch::nn::Sequential ref = copy_of(net);
      ModelExecutePlan plan;
      plan.fwd_plan = {{0, 3}, {3, 5}};
      if (!fused) plan.fwd_plan.push_back({5, 7});
      plan.bwd_plan = {{5, 7}, {3, 5}, {1, 3}, {0, 1}};
      RoundPipe model(net, RoundPipeOptions().set_max_devices(2));
      const RunConfig cfg = RunConfig().num_microbatch(3).recompute_grain(grain).execute_plan(plan);
      at::Tensor x = torch::randn({6, 16}), y = torch::randn({6, 4});
      double loss = 0, ref_loss = 0;
      if (fused) {
        loss = model.forward_backward({x}, make_kwargs(), y, mse_loss_fn(), false, cfg).toTensor().item<double>();
        auto xs = x.tensor_split(3), ys = y.tensor_split(3);
        for (int64_t m = 0; m < 3; ++m) {
          at::Tensor l = torch::mse_loss(ref->forward(xs[m]), ys[m]);
          l.backward();
          ref_loss += l.item<double>();
        }
      } else {
        at::Tensor l = torch::mse_loss(model.forward(x, cfg), y);
        l.backward();
        loss = l.item<double>();
        at::Tensor r = torch::mse_loss(ref->forward(x), y);
        r.backward();
        ref_loss = r.item<double>();
      }
      model.synchronize();
      EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss));
      expect_all_close(grads_of(net->parameters()), grads_of(ref->parameters()), 1e-5, "gradients");
    }
  }
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
