// The caller's autocast reaches the device workers: layers, recomputation and
// the loss run under it, as plain libtorch runs them inside the same
// autocast region (CPU autocast in bf16 on CPU devices).
#include <gtest/gtest.h>

#include <ATen/autocast_mode.h>

#include "models.h"

namespace roundpipe {
namespace testing {
namespace {

// CPU autocast to bf16 on this thread while it lives (what
// `with torch.autocast("cpu", dtype=torch.bfloat16)` sets).
class CpuAutocast {
 public:
  CpuAutocast() : was_(at::autocast::is_autocast_enabled(at::kCPU)), dtype_(at::autocast::get_autocast_dtype(at::kCPU)) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, was_);
    at::autocast::set_autocast_dtype(at::kCPU, dtype_);
  }

 private:
  bool was_;
  at::ScalarType dtype_;
};

// Two stages each way, on two devices.
const ModelExecutePlan kFusedPlan{{{0, 5}}, {{5, 9}, {0, 5}}};
const ModelExecutePlan kTrainPlan{{{0, 5}, {5, 9}}, {{5, 9}, {0, 5}}};

TEST(Autocast, ForwardBackwardRunsLayersRecomputationAndLossUnderTheCallersAutocast) {
  for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
    torch::manual_seed(7);
    torch::nn::Sequential net = make_mlp(32, 4, 8);
    torch::nn::Sequential ref = copy_of(net);
    RoundPipe model(net, RoundPipeOptions().set_max_devices(2));
    at::Tensor x = torch::randn({6, 32}), y = torch::randn({6, 8});
    c10::ScalarType out_dtype = c10::ScalarType::Undefined;
    LossFn loss_fn = [&](const c10::IValue& out, const c10::IValue& t) -> c10::IValue {
      out_dtype = out.toTensor().scalar_type();
      return torch::mse_loss(out.toTensor(), t.toTensor());
    };
    double loss = 0;
    {
      CpuAutocast autocast;
      loss = model
                 .forward_backward({x}, make_kwargs(), y, loss_fn, false,
                                   RunConfig().num_microbatch(2).recompute_grain(grain).execute_plan(kFusedPlan))
                 .toTensor()
                 .item<double>();
    }
    model.synchronize();
    EXPECT_EQ(out_dtype, at::kBFloat16) << "the last layer ran under autocast on its worker";
    // Plain libtorch: forward and loss inside the region, backward after it.
    double ref_loss = 0;
    auto xs = x.tensor_split(2), ys = y.tensor_split(2);
    for (int m = 0; m < 2; ++m) {
      at::Tensor l;
      {
        CpuAutocast autocast;
        l = torch::mse_loss(ref->forward(xs[m]), ys[m]);
      }
      EXPECT_EQ(l.scalar_type(), at::kFloat) << "mse_loss runs in fp32 under CPU autocast";
      l.backward();
      ref_loss += l.item<double>();
    }
    EXPECT_NEAR(loss, ref_loss, 1e-6 * std::abs(ref_loss));
    // bf16 matmuls: a forward or recomputation in fp32 would differ by far more.
    expect_all_close(grads_of(net->parameters()), grads_of(ref->parameters()), 1e-5, "gradients under autocast");
    // The worker's own autocast is left as it was: a call without autocast runs in fp32.
    for (auto& p : net->parameters()) p.mutable_grad().reset();
    model.forward_backward({x}, make_kwargs(), y, loss_fn, false, RunConfig().num_microbatch(2));
    model.synchronize();
    EXPECT_EQ(out_dtype, at::kFloat);
  }
}

TEST(Autocast, ForwardOutputsAndTheirBackwardFollowTheCallersAutocast) {
  torch::manual_seed(8);
  torch::nn::Sequential net = make_mlp(32, 4, 8);
  torch::nn::Sequential ref = copy_of(net);
  RoundPipe model(net, RoundPipeOptions().set_max_devices(2));
  at::Tensor x = torch::randn({4, 32});
  at::Tensor out, ref_out;
  {
    CpuAutocast autocast;
    out = model.forward(x, RunConfig().num_microbatch(1).execute_plan(kTrainPlan));
    ref_out = ref->forward(x);
  }
  ASSERT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(out.equal(ref_out));
  // The backward stages recompute under the forward's autocast.
  out.to(at::kFloat).square().sum().backward();
  ref_out.to(at::kFloat).square().sum().backward();
  model.synchronize();
  expect_all_close(grads_of(net->parameters()), grads_of(ref->parameters()), 1e-5, "gradients of forward()");
  at::Tensor plain = model.forward(x, RunConfig().num_microbatch(1).requires_grad(false));
  EXPECT_EQ(plain.scalar_type(), at::kFloat) << "outside the region: fp32";
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
