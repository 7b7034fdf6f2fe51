// step(): the synchronous trajectory equals plain libtorch training; the
// asynchronous one equals the exact one-step-delay definition; warm-up,
// redirection, OptimizerCtx, refresh-on-load, frozen parameters, errors,
// mixed precision.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "models.h"

namespace roundpipe {
namespace testing {
namespace {

using ::testing::HasSubstr;

LossFn mse() {
  return [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return torch::mse_loss(out.toTensor(), y.toTensor());
  };
}

struct Data {
  std::vector<at::Tensor> xs, ys;
};

Data make_data(int steps) {
  Data d;
  for (int i = 0; i < steps; ++i) {
    d.xs.push_back(torch::randn({6, 16}));
    d.ys.push_back(torch::randn({6, 4}));
  }
  return d;
}

// Plain libtorch: gradient of the microbatch loop at the given parameters.
void reference_grads(torch::nn::Sequential& ref, const at::Tensor& x, const at::Tensor& y, int64_t m) {
  auto xs = x.tensor_split(m), ys = y.tensor_split(m);
  for (int64_t i = 0; i < m; ++i) torch::mse_loss(ref->forward(xs[i]), ys[i]).backward();
}

void set_values(torch::nn::Sequential& net, const std::vector<at::Tensor>& values) {
  torch::NoGradGuard no_grad;
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
}

// Trains with roundpipe for `steps` steps; warm-up steps are synchronous.
std::vector<at::Tensor> train_roundpipe(torch::nn::Sequential net, const Data& d, bool is_async,
                                        int64_t devices, RoundPipeOptions options = {}) {
  RoundPipe model(net, options.set_max_devices(devices));
  torch::optim::Adam opt(model.optim_parameters(), torch::optim::AdamOptions(1e-2));
  for (size_t k = 0; k < d.xs.size(); ++k) {
    model.forward_backward({d.xs[k]}, make_kwargs(), d.ys[k], mse(), false, RunConfig().num_microbatch(3));
    model.step(
        [&] {
          opt.step();
          opt.zero_grad();
        },
        is_async);
  }
  model.synchronize();
  return values_of(net->parameters());
}

TEST(Step, SynchronousTrajectoryEqualsPlainLibtorch) {
  torch::manual_seed(21);
  torch::nn::Sequential net = make_mlp();
  torch::nn::Sequential ref = copy_of(net);
  Data d = make_data(6);
  auto got = train_roundpipe(net, d, /*is_async=*/false, 2);
  torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
  for (size_t k = 0; k < d.xs.size(); ++k) {
    reference_grads(ref, d.xs[k], d.ys[k], 3);
    opt.step();
    opt.zero_grad();
  }
  expect_all_close(got, values_of(ref->parameters()), 1e-6, "parameters after 6 synchronous steps");
}

// The one-step-delay definition: call k sees θ_{max(k-2, 0)}; step k applies
// its gradient to θ_{k-1}. `warmup` first steps are synchronous.
std::vector<at::Tensor> delayed_reference(torch::nn::Sequential theta, const Data& d, int64_t warmup) {
  torch::nn::Sequential view = copy_of(theta);
  torch::optim::Adam opt(theta->parameters(), torch::optim::AdamOptions(1e-2));
  std::vector<at::Tensor> seen = values_of(theta->parameters());  // what the next call sees
  for (size_t k = 1; k <= d.xs.size(); ++k) {
    set_values(view, seen);
    for (auto& p : view->parameters()) p.mutable_grad().reset();
    reference_grads(view, d.xs[k - 1], d.ys[k - 1], 3);
    auto theta_params = theta->parameters(), view_params = view->parameters();
    for (size_t i = 0; i < theta_params.size(); ++i) theta_params[i].mutable_grad() = view_params[i].grad().clone();
    std::vector<at::Tensor> before = values_of(theta->parameters());  // θ_{k-1}
    opt.step();
    opt.zero_grad();
    const bool delayed = static_cast<int64_t>(k) > warmup;
    seen = delayed ? before : values_of(theta->parameters());
  }
  return values_of(theta->parameters());
}

TEST(Step, AsynchronousTrajectoryEqualsOneStepDelayReference) {
  for (int64_t devices : {1, 3}) {
    torch::manual_seed(22);
    torch::nn::Sequential net = make_mlp();
    torch::nn::Sequential ref = copy_of(net);
    Data d = make_data(6);
    auto got = train_roundpipe(net, d, /*is_async=*/true, devices);
    // delayed_reference trains the Sequential it is given: each reference
    // starts from a copy of the initial weights.
    expect_all_close(got, delayed_reference(copy_of(ref), d, 0), 1e-6, "async parameters");
    // And it is really delayed: the synchronous reference differs.
    EXPECT_FALSE(torch::allclose(got[0], delayed_reference(copy_of(ref), d, 100)[0]));
  }
}

TEST(Step, WarmupStepsAreSynchronousThenTheDelayStarts) {
  torch::manual_seed(23);
  torch::nn::Sequential net = make_mlp();
  torch::nn::Sequential ref = copy_of(net);
  Data d = make_data(5);
  // The per-model option; then the deprecated process-wide default it falls back to.
  for (bool per_model : {true, false}) {
    SCOPED_TRACE(per_model ? "RoundPipeOptions::sync_warmup_steps" : "set_sync_warmup_steps");
    torch::nn::Sequential trained = copy_of(ref);
    RoundPipeOptions options;
    if (per_model) options.set_sync_warmup_steps(2);
    if (!per_model) set_sync_warmup_steps(2);
    auto got = train_roundpipe(trained, d, /*is_async=*/true, 2, options);
    set_sync_warmup_steps(0);
    expect_all_close(got, delayed_reference(copy_of(ref), d, 2), 1e-6, "parameters with 2 warm-up steps");
    EXPECT_FALSE(torch::allclose(got[0], delayed_reference(copy_of(ref), d, 1)[0]));
    EXPECT_FALSE(torch::allclose(got[0], delayed_reference(copy_of(ref), d, 3)[0]));
  }
  EXPECT_THROW(set_sync_warmup_steps(-1), c10::ValueError);
  EXPECT_THROW(RoundPipe(copy_of(ref), RoundPipeOptions().set_sync_warmup_steps(-1)), c10::ValueError);
}

TEST(Step, ParametersRedirectToOptimizerCopiesInsideStepFnAndOptimizerCtx) {
  torch::nn::Sequential net = make_mlp();
  RoundPipe model(net);
  auto optim = model.optim_parameters();
  ASSERT_EQ(optim.size(), net->parameters().size());
  for (size_t i = 0; i < optim.size(); ++i) {
    EXPECT_NE(optim[i].unsafeGetTensorImpl(), net->parameters()[i].unsafeGetTensorImpl());
    EXPECT_TRUE(torch::equal(optim[i], net->parameters()[i]));
  }
  EXPECT_EQ(model.parameters()[0].unsafeGetTensorImpl(), net->parameters()[0].unsafeGetTensorImpl());
  const c10::TensorImpl* seen = nullptr;
  model.step([&] { seen = model.parameters()[0].unsafeGetTensorImpl(); }, /*is_async=*/false);
  EXPECT_EQ(seen, optim[0].unsafeGetTensorImpl());
  {
    OptimizerCtx ctx;
    EXPECT_EQ(model.parameters()[0].unsafeGetTensorImpl(), optim[0].unsafeGetTensorImpl());
    EXPECT_EQ(model.named_parameters()[0].first, "0.weight");
  }
  EXPECT_EQ(model.parameters()[0].unsafeGetTensorImpl(), net->parameters()[0].unsafeGetTensorImpl());
}

TEST(Step, LoadingWeightsAfterCreatingTheOptimizerIsNotUndone) {
  torch::manual_seed(24);
  torch::nn::Sequential net = make_mlp();
  RoundPipe model(net);
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.0));  // lr 0: step changes nothing
  std::vector<std::pair<std::string, at::Tensor>> loaded;
  for (auto& [name, t] : model.state_dict()) loaded.emplace_back(name, torch::full_like(t, 0.5));
  model.load_state_dict(loaded);
  model.forward_backward({torch::randn({4, 16})}, make_kwargs(), torch::randn({4, 4}), mse());
  model.step([&] { opt.step(); }, /*is_async=*/false);
  for (auto& p : net->parameters()) EXPECT_TRUE(torch::equal(p, torch::full_like(p, 0.5)));
  // Strict loading names what is wrong and changes nothing.
  loaded.pop_back();
  try {
    model.load_state_dict(loaded);
    FAIL();
  } catch (const c10::ValueError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("missing 1 entries"));
  }
}

TEST(Step, FrozenParametersGetNoOptimizerCopyAndStayUnchanged) {
  torch::manual_seed(25);
  torch::nn::Sequential net = make_mlp();
  auto frozen = net->parameters()[0];
  frozen.requires_grad_(false);
  at::Tensor before = frozen.detach().clone();
  at::Tensor trained_before = net->parameters()[1].detach().clone();
  RoundPipe model(net);
  EXPECT_EQ(model.optim_parameters().size(), net->parameters().size() - 1);
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.1));
  for (int i = 0; i < 3; ++i) {
    model.forward_backward({torch::randn({4, 16})}, make_kwargs(), torch::randn({4, 4}), mse());
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
  }
  model.synchronize();
  EXPECT_TRUE(torch::equal(frozen, before));
  EXPECT_FALSE(frozen.grad().defined());
  EXPECT_FALSE(torch::equal(net->parameters()[1], trained_before));
}

struct StepFnError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

TEST(Step, ErrorInAsyncStepFnIsRaisedByTheNextCallAndTheModelStaysUsable) {
  torch::nn::Sequential net = make_mlp();
  RoundPipe model(net, RoundPipeOptions().set_name("stepper"));
  model.forward_backward({torch::randn({4, 16})}, make_kwargs(), torch::randn({4, 4}), mse());
  model.step([] { TORCH_CHECK_VALUE(false, "step_fn exploded"); });
  try {
    model.step([] {});
    FAIL() << "expected the step_fn error";
  } catch (const c10::ValueError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("step_fn exploded"));
    EXPECT_THAT(std::string(e.what()), HasSubstr("RoundPipe model 'stepper': step 1"));
  }
  model.forward_backward({torch::randn({4, 16})}, make_kwargs(), torch::randn({4, 4}), mse());
  model.step([] {}, /*is_async=*/false);
  model.step([] { throw std::runtime_error("sync failure"); }, /*is_async=*/true);
  EXPECT_THROW(model.synchronize(), std::runtime_error);
  model.synchronize();  // reported once
  EXPECT_THROW(model.step([] { throw std::out_of_range("sync step"); }, /*is_async=*/false), std::out_of_range);
  EXPECT_THROW(model.step(StepFn()), c10::ValueError);
}

TEST(Step, Bf16ModelWithFp32OptimizerCopiesTrains) {
  torch::manual_seed(26);
  torch::nn::Sequential net = make_mlp();
  net->to(torch::kBFloat16);
  RoundPipe model(net, RoundPipeOptions().set_optim_dtype(torch::kFloat).set_max_devices(2));
  for (const auto& p : model.optim_parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
  torch::optim::Adam opt(model.optim_parameters(), torch::optim::AdamOptions(1e-2));
  at::Tensor x = torch::randn({8, 16}).to(torch::kBFloat16), y = torch::randn({8, 4}).to(torch::kBFloat16);
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return torch::mse_loss(out.toTensor().to(torch::kFloat), y.toTensor().to(torch::kFloat));
  };
  double first = 0, last = 0;
  for (int i = 0; i < 30; ++i) {
    last = model.forward_backward({x}, make_kwargs(), y, loss_fn).toTensor().item<double>();
    if (i == 0) first = last;
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
  }
  model.synchronize();
  EXPECT_LT(last, first * 0.8);
  // The model holds the optimizer copies rounded to bf16.
  auto optim = model.optim_parameters();
  for (size_t i = 0; i < optim.size(); ++i) {
    EXPECT_EQ(net->parameters()[i].scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(net->parameters()[i], optim[i].detach().to(torch::kBFloat16)));
  }
}

TEST(Step, SynchronizeHandsPendingGradientsToGradAndAStepTakesThem) {
  torch::manual_seed(27);
  torch::nn::Sequential net = make_mlp();
  torch::nn::Sequential ref = copy_of(net);
  RoundPipe model(net);
  at::Tensor x = torch::randn({6, 16}), y = torch::randn({6, 4});
  model.forward_backward({x}, make_kwargs(), y, mse(), false, RunConfig().num_microbatch(3));
  model.synchronize();
  reference_grads(ref, x, y, 3);
  expect_all_close(grads_of(net->parameters()), grads_of(ref->parameters()), 1e-6, ".grad after synchronize");
  // The step still receives them (from .grad), and .grad is then empty.
  std::vector<at::Tensor> handed;
  model.step([&] {
    for (auto& p : model.parameters()) handed.push_back(p.grad().clone());
  }, /*is_async=*/false);
  expect_all_close(handed, grads_of(ref->parameters()), 1e-6, "gradients handed to the optimizer copies");
  EXPECT_FALSE(net->parameters()[0].grad().defined());
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
