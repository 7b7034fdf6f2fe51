// GradScaler: scale sequences, skipped steps and parameters against a
// hand-computed schedule and a plain-libtorch reference (synchronous and
// asynchronous); thread rules, the optimizer-thread hook, disabled scaler,
// state dicts, options, IValue trees.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <set>
#include <thread>

#include "engine/optimizer_thread.h"
#include "models.h"

namespace roundpipe {
namespace testing {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kInfF = std::numeric_limits<float>::infinity();
constexpr double kLr = 0.1;

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

GradScalerOptions schedule_options() {
  return GradScalerOptions().set_init_scale(1024).set_growth_interval(3);
}

// What one training run observed.
struct Trace {
  std::vector<double> main_scales;  // get_scale() on the main thread after each update()
  std::vector<double> step_scales;  // get_scale() inside step_fn, before scaler.step()
  std::vector<bool> skipped;
  std::vector<std::vector<at::Tensor>> thetas;  // optimizer copies after each step
};

// RoundPipe training with the scaler; loss_fn multiplies by inf at the
// iterations in `inf_at`.
Trace train_roundpipe(torch::nn::Sequential net, const Data& d, bool is_async, const std::set<int>& inf_at) {
  RoundPipe model(net, RoundPipeOptions().set_max_devices(2));
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(kLr));
  GradScaler scaler(schedule_options());
  const std::vector<at::Tensor> optim_params = model.optim_parameters();
  Trace trace;
  int iteration = 0;
  LossFn loss_fn = [&](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    at::Tensor loss = torch::mse_loss(out.toTensor(), y.toTensor());
    if (inf_at.count(iteration)) loss = loss * kInf;
    return scaler.scale(loss);
  };
  for (size_t k = 0; k < d.xs.size(); ++k) {
    iteration = static_cast<int>(k);
    model.forward_backward({d.xs[k]}, make_kwargs(), d.ys[k], loss_fn, false, RunConfig().num_microbatch(3));
    model.step(
        [&] {
          // A slow optimizer: asynchronously, this iteration's update() runs
          // first, and the step must still use the scale of its own epoch.
          if (is_async) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          trace.step_scales.push_back(scaler.get_scale());
          trace.skipped.push_back(!scaler.step(opt).has_value());
          trace.thetas.push_back(values_of(optim_params));
          opt.zero_grad();
        },
        is_async);
    scaler.update(c10::nullopt, is_async);
    trace.main_scales.push_back(scaler.get_scale());
  }
  model.synchronize();
  return trace;
}

void set_values(torch::nn::Sequential& net, const std::vector<at::Tensor>& values) {
  torch::NoGradGuard no_grad;
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
}

// Plain libtorch with the scaler's rules written out: the scale chain, the
// asynchronous scale lag and (asynchronous) the one-step delay of RoundPipe::step.
Trace reference(torch::nn::Sequential theta, const Data& d, bool is_async, const std::set<int>& inf_at) {
  const GradScalerOptions o = schedule_options();
  torch::nn::Sequential view = copy_of(theta);
  torch::optim::SGD opt(theta->parameters(), torch::optim::SGDOptions(kLr));
  Trace trace;
  double chain_scale = o.init_scale;
  int64_t tracker = 0;
  double s = o.init_scale;  // S_k, the scale of the current epoch
  std::vector<at::Tensor> seen = values_of(theta->parameters());
  for (size_t k = 0; k < d.xs.size(); ++k) {
    set_values(view, seen);
    for (auto& p : view->parameters()) p.mutable_grad().reset();
    auto xs = d.xs[k].tensor_split(3), ys = d.ys[k].tensor_split(3);
    for (int m = 0; m < 3; ++m) {
      at::Tensor loss = torch::mse_loss(view->forward(xs[m]), ys[m]);
      if (inf_at.count(static_cast<int>(k))) loss = loss * kInf;
      (loss * s).backward();
    }
    const float inv = static_cast<float>(1.0 / s);
    bool found = false;
    auto theta_params = theta->parameters(), view_params = view->parameters();
    for (size_t i = 0; i < theta_params.size(); ++i) {
      at::Tensor g = view_params[i].grad().clone();
      found |= !torch::isfinite(g).all().item<bool>();
      theta_params[i].mutable_grad() = g * inv;
    }
    trace.step_scales.push_back(s);
    trace.skipped.push_back(found);
    std::vector<at::Tensor> before = values_of(theta->parameters());
    if (!found) opt.step();
    opt.zero_grad();
    trace.thetas.push_back(values_of(theta->parameters()));
    const double state_k_scale = chain_scale;
    if (found) {
      chain_scale = std::min(chain_scale, s * o.backoff_factor);
      tracker = 0;
    } else if (++tracker == o.growth_interval) {
      chain_scale *= o.growth_factor;
      tracker = 0;
    }
    s = is_async ? state_k_scale : chain_scale;
    trace.main_scales.push_back(s);
    seen = is_async ? before : values_of(theta->parameters());
  }
  return trace;
}

void expect_same_run(const Trace& got, const Trace& want) {
  EXPECT_THAT(got.main_scales, ElementsAreArray(want.main_scales));
  EXPECT_THAT(got.step_scales, ElementsAreArray(want.step_scales));
  EXPECT_THAT(got.skipped, ElementsAreArray(want.skipped));
  ASSERT_EQ(got.thetas.size(), want.thetas.size());
  for (size_t k = 0; k < got.thetas.size(); ++k) {
    expect_all_close(got.thetas[k], want.thetas[k], 1e-6, "parameters after step " + std::to_string(k));
  }
}

const std::set<int> kInfAt = {2, 3, 7};
const std::vector<bool> kSkipped = {false, false, true, true, false, false, false, true, false, false};

TEST(GradScaler, SynchronousTrainingFollowsTorchsScaleRule) {
  torch::manual_seed(41);
  torch::nn::Sequential net = make_mlp(16, 2);
  torch::nn::Sequential ref = copy_of(net);
  Data d = make_data(10);
  Trace got = train_roundpipe(net, d, /*is_async=*/false, kInfAt);
  // By hand: backoff at 2 and 3, growth after 3 clean steps (4, 5, 6), backoff at 7.
  EXPECT_THAT(got.main_scales, ElementsAreArray({1024., 1024., 512., 256., 256., 256., 512., 256., 256., 256.}));
  EXPECT_THAT(got.step_scales, ElementsAreArray({1024., 1024., 1024., 512., 256., 256., 256., 512., 256., 256.}));
  EXPECT_THAT(got.skipped, ElementsAreArray(kSkipped));
  expect_same_run(got, reference(ref, d, /*is_async=*/false, kInfAt));
}

TEST(GradScaler, AsynchronousTrainingLagsOneUpdateAndDoesNotBackOffTwice) {
  torch::manual_seed(42);
  torch::nn::Sequential net = make_mlp(16, 2);
  torch::nn::Sequential ref = copy_of(net);
  Data d = make_data(10);
  Trace got = train_roundpipe(net, d, /*is_async=*/true, kInfAt);
  // By hand: S_{k+1} = state_k. Step 3 overflowed with S_3 = 1024, already
  // backed off from by step 2: stays 512. Growth after steps 4, 5, 6; step 7
  // overflowed with S_7 = 512: min(1024, 256).
  EXPECT_THAT(got.main_scales, ElementsAreArray({1024., 1024., 1024., 512., 512., 512., 512., 1024., 256., 256.}));
  EXPECT_THAT(got.step_scales,
              ElementsAreArray({1024., 1024., 1024., 1024., 512., 512., 512., 512., 1024., 256.}));
  EXPECT_THAT(got.skipped, ElementsAreArray(kSkipped));
  // reference() trains the Sequential it is given: each starts from a copy
  // of the initial weights.
  expect_same_run(got, reference(copy_of(ref), d, /*is_async=*/true, kInfAt));
  // The reference is sensitive to the delay: the synchronous one differs.
  Trace sync = reference(copy_of(ref), d, /*is_async=*/false, kInfAt);
  EXPECT_FALSE(torch::allclose(got.thetas.back()[0], sync.thetas.back()[0]));
}

// Plain training (no RoundPipe: everything runs on the calling thread) with
// two optimizers: only the one with an inf gradient skips, both count.
TEST(GradScaler, EachOptimizerSkipsOnItsOwnInfButTheScaleBacksOffForAll) {
  at::Tensor a = torch::ones({3}, torch::requires_grad()), b = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD opt_a({a}, torch::optim::SGDOptions(1.0)), opt_b({b}, torch::optim::SGDOptions(1.0));
  GradScaler scaler(GradScalerOptions().set_init_scale(8));
  a.mutable_grad() = torch::tensor({8.f, kInfF, 8.f});
  b.mutable_grad() = torch::full({3}, 16.f);
  EXPECT_FALSE(scaler.step(opt_a).has_value());
  EXPECT_TRUE(scaler.step(opt_b).has_value());
  scaler.update(c10::nullopt, /*is_async=*/false);
  EXPECT_TRUE(torch::equal(a, torch::ones({3})));
  EXPECT_TRUE(torch::equal(b, torch::full({3}, -1.f)));  // 1 - 16 / 8
  EXPECT_EQ(scaler.get_scale(), 4.0);
  // Next iteration: unscaled by 4.
  a.mutable_grad() = torch::full({3}, 4.f);
  b.mutable_grad() = torch::full({3}, 4.f);
  EXPECT_TRUE(scaler.step(opt_a).has_value());
  EXPECT_TRUE(scaler.step(opt_b).has_value());
  scaler.update();
  EXPECT_TRUE(torch::equal(a, torch::zeros({3})));
  EXPECT_TRUE(torch::equal(b, torch::full({3}, -2.f)));
}

// Optimizers first used after training started take the step of their
// step_fn, whether they come before (B) or after (C) an older one (A).
TEST(GradScaler, ANewOptimizerJoinsTheStepOfItsStepFn) {
  RoundPipe model(make_mlp(16, 1), RoundPipeOptions().set_max_devices(1));
  const std::vector<at::Tensor> params = model.optim_parameters();
  torch::optim::SGD opt_a({params[0]}, torch::optim::SGDOptions(0.0));
  torch::optim::SGD opt_b({params[1]}, torch::optim::SGDOptions(0.0));
  torch::optim::SGD opt_c({params[2]}, torch::optim::SGDOptions(0.0));
  GradScaler scaler(GradScalerOptions().set_init_scale(8));
  auto set_grad = [](at::Tensor p, double v) { p.mutable_grad() = torch::full_like(p, v); };
  auto grad_value = [](const at::Tensor& p) { return p.grad().max().item<double>(); };
  std::vector<double> a_seen, b_seen, c_seen;
  for (int k = 0; k < 4; ++k) {
    model.step([&, k] {
      // Scales: S_0 = S_1 = 8; the inf of step 0 halves S_2 = S_3 = 4.
      if (k >= 2) {
        set_grad(params[1], 4 * 1.5);
        scaler.step(opt_b);
        b_seen.push_back(grad_value(params[1]));
      }
      set_grad(params[0], k == 0 ? kInf : (k == 1 ? 8 : 4) * 1.0);
      scaler.step(opt_a);
      a_seen.push_back(grad_value(params[0]));
      if (k >= 2) {
        set_grad(params[2], 4 * 2.5);
        scaler.step(opt_c);
        c_seen.push_back(grad_value(params[2]));
      }
    });
    scaler.update();
  }
  model.synchronize();
  EXPECT_THAT(a_seen, ElementsAreArray({kInf, 1.0, 1.0, 1.0}));
  EXPECT_THAT(b_seen, ElementsAreArray({1.5, 1.5}));
  EXPECT_THAT(c_seen, ElementsAreArray({2.5, 2.5}));
  EXPECT_EQ(scaler.get_scale(), 4.0);
}

TEST(GradScaler, UpdateOffTheMainThreadThrows) {
  GradScaler scaler;
  std::string message;
  std::thread other([&] {
    try {
      scaler.update();
    } catch (const c10::Error& e) {
      message = e.what();
    }
  });
  other.join();
  EXPECT_THAT(message, HasSubstr("must be called on the thread that created the scaler"));
  scaler.update();  // fine here: nothing needed before the first asynchronous update
  EXPECT_EQ(scaler.get_scale(), 65536.0);
}

TEST(GradScaler, UnscaleTwiceThrowsAndStepDoesNotUnscaleAgain) {
  at::Tensor w = torch::zeros({2}, torch::requires_grad());
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(1.0));
  GradScaler scaler(GradScalerOptions().set_init_scale(4));
  w.mutable_grad() = torch::full({2}, 8.f);
  scaler.unscale_(opt);
  EXPECT_TRUE(torch::equal(w.grad(), torch::full({2}, 2.f)));
  try {
    scaler.unscale_(opt);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("unscale_() has already been called on this optimizer"));
  }
  ASSERT_TRUE(scaler.step(opt).has_value());
  EXPECT_TRUE(torch::equal(w, torch::full({2}, -2.f)));
  scaler.update();
  // A new step may unscale again.
  w.mutable_grad() = torch::full({2}, 8.f);
  scaler.unscale_(opt);
  EXPECT_TRUE(torch::equal(w.grad(), torch::full({2}, 2.f)));
}

TEST(GradScaler, UpdateWithoutAStepThrows) {
  GradScaler sync_scaler;
  try {
    sync_scaler.update(c10::nullopt, /*is_async=*/false);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("no scaler.step() was recorded"));
  }
  GradScaler async_scaler;
  async_scaler.update();  // needs nothing yet
  EXPECT_THROW(async_scaler.update(), c10::Error);  // needs step 0
}

TEST(GradScaler, OptimizerThreadHookRunsBehindQueuedStepsAndPropagatesErrors) {
  bool inline_flag = true;
  run_on_optimizer_thread([&] { inline_flag = on_optimizer_thread(); });  // no model stepped: inline
  EXPECT_FALSE(inline_flag);
  RoundPipe model(make_mlp(16, 1));
  std::thread::id step_thread, hook_thread;
  bool step_done = false, saw_step_done = false, hook_on_optimizer_thread = false;
  model.step([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    step_thread = std::this_thread::get_id();
    step_done = true;
  });
  run_on_optimizer_thread([&] {
    hook_thread = std::this_thread::get_id();
    saw_step_done = step_done;
    hook_on_optimizer_thread = on_optimizer_thread();
  });
  EXPECT_TRUE(saw_step_done);
  EXPECT_TRUE(hook_on_optimizer_thread);
  EXPECT_EQ(hook_thread, step_thread);
  EXPECT_NE(hook_thread, std::this_thread::get_id());
  EXPECT_FALSE(on_optimizer_thread());
  EXPECT_THROW(run_on_optimizer_thread([] { TORCH_CHECK_VALUE(false, "boom"); }), c10::ValueError);
  model.synchronize();
}

TEST(GradScaler, UnscaleFromTheMainThreadRunsOnTheOptimizerThreadAfterQueuedSteps) {
  torch::manual_seed(43);
  RoundPipe model(make_mlp(16, 1), RoundPipeOptions().set_max_devices(1));
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.0));
  GradScaler scaler(GradScalerOptions().set_init_scale(64));
  bool grads_set_on_optimizer_thread = false;
  model.step([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    for (at::Tensor& p : model.parameters()) p.mutable_grad() = torch::full_like(p, 3 * 64.0);
    grads_set_on_optimizer_thread = on_optimizer_thread();
  });
  scaler.unscale_(opt);  // queued behind the step above
  EXPECT_TRUE(grads_set_on_optimizer_thread);
  for (const at::Tensor& p : model.optim_parameters()) EXPECT_TRUE(torch::equal(p.grad(), torch::full_like(p, 3.0)));
  // step() from the main thread also runs there and returns the optimizer's result.
  EXPECT_TRUE(scaler.step(opt).has_value());
  scaler.update(c10::nullopt, /*is_async=*/false);
  EXPECT_EQ(scaler.get_scale(), 64.0);
}

TEST(GradScaler, DisabledScalerIsTransparent) {
  GradScaler scaler(GradScalerOptions().set_enabled(false).set_init_scale(8));
  EXPECT_FALSE(scaler.is_enabled());
  at::Tensor loss = torch::tensor(2.5);
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  EXPECT_EQ(scaler.get_scale(), 1.0);
  at::Tensor w = torch::zeros({2}, torch::requires_grad());
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(1.0));
  w.mutable_grad() = torch::tensor({1.f, kInfF});
  scaler.unscale_(opt);
  EXPECT_TRUE(torch::equal(w.grad(), torch::tensor({1.f, kInfF})));
  EXPECT_TRUE(scaler.step(opt).has_value());  // not skipped, not unscaled
  EXPECT_EQ(w[0].item<float>(), -1.f);
  EXPECT_NO_THROW(scaler.update(c10::nullopt, /*is_async=*/false));
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_EQ(scaler.state_dict().size(), 0u);
  EXPECT_TRUE(scaler.prepare_step(1, {torch::tensor({kInf})}));
}

TEST(GradScaler, StateDictHasTorchsKeysAndRoundTrips) {
  GradScaler scaler(GradScalerOptions().set_init_scale(32).set_growth_interval(5));
  at::Tensor w = torch::zeros({2}, torch::requires_grad());
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.1));
  for (int i = 0; i < 3; ++i) {
    w.mutable_grad() = torch::ones({2});
    scaler.step(opt);
    scaler.update(c10::nullopt, /*is_async=*/false);
  }
  scaler.set_backoff_factor(0.25);
  auto state = scaler.state_dict();
  std::vector<std::string> keys;
  for (const auto& entry : state) keys.push_back(entry.key());
  EXPECT_THAT(keys, ::testing::UnorderedElementsAre("scale", "growth_factor", "backoff_factor", "growth_interval",
                                                    "_growth_tracker"));
  EXPECT_EQ(state.at("scale").toDouble(), 32.0);
  EXPECT_EQ(state.at("_growth_tracker").toInt(), 3);
  EXPECT_EQ(state.at("growth_interval").toInt(), 5);
  EXPECT_EQ(state.at("backoff_factor").toDouble(), 0.25);

  GradScaler loaded;
  loaded.load_state_dict(state);
  EXPECT_EQ(loaded.get_scale(), 32.0);
  EXPECT_EQ(loaded.get_growth_interval(), 5);
  EXPECT_EQ(loaded.get_backoff_factor(), 0.25);
  EXPECT_EQ(loaded.get_growth_factor(), 2.0);
  // Two more clean steps complete the interval of 5: the loaded tracker counts.
  at::Tensor v = torch::zeros({2}, torch::requires_grad());
  torch::optim::SGD opt_v({v}, torch::optim::SGDOptions(0.1));
  for (int i = 0; i < 2; ++i) {
    v.mutable_grad() = torch::ones({2});
    loaded.step(opt_v);
    loaded.update(c10::nullopt, /*is_async=*/false);
  }
  EXPECT_EQ(loaded.get_scale(), 64.0);
  // A dict from a disabled scaler, a missing key, a wrong type.
  auto empty = c10::impl::toTypedDict<std::string, c10::IValue>(
      c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
  EXPECT_THROW(loaded.load_state_dict(empty), c10::Error);
  auto missing = state.copy();
  ASSERT_EQ(missing.erase("_growth_tracker"), 1u);
  EXPECT_THROW(loaded.load_state_dict(missing), c10::ValueError);
  auto wrong = state.copy();
  wrong.insert_or_assign("growth_interval", c10::IValue(2.5));
  EXPECT_THROW(loaded.load_state_dict(wrong), c10::TypeError);
}

TEST(GradScaler, InvalidOptionsRaiseValueError) {
  EXPECT_THROW(GradScaler(GradScalerOptions().set_init_scale(0)), c10::ValueError);
  EXPECT_THROW(GradScaler(GradScalerOptions().set_init_scale(kInf)), c10::ValueError);
  EXPECT_THROW(GradScaler(GradScalerOptions().set_growth_factor(1.0)), c10::ValueError);
  EXPECT_THROW(GradScaler(GradScalerOptions().set_backoff_factor(1.0)), c10::ValueError);
  EXPECT_THROW(GradScaler(GradScalerOptions().set_backoff_factor(0.0)), c10::ValueError);
  EXPECT_THROW(GradScaler(GradScalerOptions().set_growth_interval(0)), c10::ValueError);
  GradScaler scaler;
  EXPECT_THROW(scaler.set_growth_factor(0.5), c10::ValueError);
  EXPECT_THROW(scaler.update(-1.0), c10::ValueError);
  EXPECT_EQ(scaler.get_scale(), 65536.0);
}

TEST(GradScaler, NewScaleTakesEffectAtOnce) {
  GradScaler scaler(GradScalerOptions().set_init_scale(16).set_growth_interval(2));
  at::Tensor w = torch::zeros({1}, torch::requires_grad());
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.1));
  w.mutable_grad() = torch::ones({1});
  scaler.step(opt);
  scaler.update(c10::nullopt, /*is_async=*/false);  // tracker 1
  w.mutable_grad() = torch::tensor({kInf});
  scaler.step(opt);
  scaler.update(3.0);  // this step's inf is ignored, the tracker kept
  EXPECT_EQ(scaler.get_scale(), 3.0);
  EXPECT_TRUE(torch::allclose(scaler.scale(torch::tensor(2.0)), torch::tensor(6.0)));
  w.mutable_grad() = torch::ones({1});
  scaler.step(opt);
  scaler.update(c10::nullopt, /*is_async=*/false);  // tracker 2: growth
  EXPECT_EQ(scaler.get_scale(), 6.0);
}

TEST(GradScaler, ScalesEveryTensorOfATupleOrDict) {
  GradScaler scaler(GradScalerOptions().set_init_scale(4));
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("a", torch::tensor(1.0));
  dict.insert("n", c10::IValue(7));
  c10::IValue tree = c10::ivalue::Tuple::create({torch::tensor({1.0, 2.0}), dict});
  c10::IValue scaled = scaler.scale(tree);
  const auto& elems = scaled.toTupleRef().elements();
  ASSERT_EQ(elems.size(), 2u);
  EXPECT_TRUE(torch::equal(elems[0].toTensor(), torch::tensor({4.0, 8.0})));
  auto out = elems[1].toGenericDict();
  EXPECT_TRUE(torch::equal(out.at("a").toTensor(), torch::tensor(4.0)));
  EXPECT_EQ(out.at("n").toInt(), 7);
  // The input is unchanged.
  EXPECT_TRUE(torch::equal(tree.toTupleRef().elements()[0].toTensor(), torch::tensor({1.0, 2.0})));
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
