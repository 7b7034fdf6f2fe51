// Errors reach the caller with context; a failed call changes nothing; the
// model stays usable; bad arguments get clear c10::ValueErrors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "models.h"

namespace roundpipe {
namespace testing {
namespace {

using ::testing::HasSubstr;

// Passes its input through, but throws on any row whose first value is 999.
struct TripwireImpl : torch::nn::Cloneable<TripwireImpl> {
  void reset() override {}
  at::Tensor forward(at::Tensor x) {
    TORCH_CHECK_VALUE(!(x.select(1, 0) == 999).any().item<bool>(), "tripwire hit");
    return x;
  }
};
TORCH_MODULE(Tripwire);

struct Fixture {
  Fixture()
      : net(torch::nn::Identity(), torch::nn::Identity(), Tripwire(), torch::nn::Linear(4, 2)),
        model(net, RoundPipeOptions().set_max_devices(2).set_name("tripwire-model")) {}
  torch::nn::Sequential net;
  RoundPipe model;
  RunConfig cfg = RunConfig().num_microbatch(3).execute_plan(
      ModelExecutePlan{{{0, 2}, {2, 3}}, {{3, 4}, {2, 3}, {0, 2}}});
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue&) -> c10::IValue { return out.toTensor().sum(); };
};

TEST(Errors, LayerErrorReachesCallerWithContextAndChangesNothing) {
  torch::manual_seed(11);
  Fixture f;
  at::Tensor good = torch::randn({6, 4});
  f.model.forward_backward({good}, make_kwargs(), c10::IValue(), f.loss_fn, false, f.cfg);
  // Same call again as the reference for "what the gradients should be".
  at::Tensor bad = good.clone();
  bad[5][0] = 999;  // microbatch 2 of 3
  try {
    f.model.forward_backward({bad}, make_kwargs(), c10::IValue(), f.loss_fn, false, f.cfg);
    FAIL() << "expected the tripwire to fire";
  } catch (const c10::ValueError& e) {
    const std::string msg = e.what();
    EXPECT_THAT(msg, HasSubstr("tripwire hit"));
    EXPECT_THAT(msg, HasSubstr("RoundPipe model 'tripwire-model'"));
    EXPECT_THAT(msg, HasSubstr("forward stage 1 (layers 2..2)"));
    EXPECT_THAT(msg, HasSubstr("layer 2"));
    EXPECT_THAT(msg, HasSubstr("microbatch 2"));
    EXPECT_THAT(msg, HasSubstr("device cpu:"));
  }
  // The failed call added nothing: gradients equal one good call's.
  f.model.synchronize();
  std::vector<at::Tensor> after_failure = grads_of(f.net->parameters());
  for (auto& p : f.net->parameters()) p.mutable_grad().reset();
  f.model.forward_backward({good}, make_kwargs(), c10::IValue(), f.loss_fn, false, f.cfg);
  f.model.synchronize();
  for (size_t i = 0; i < after_failure.size(); ++i) {
    EXPECT_TRUE(torch::equal(after_failure[i], f.net->parameters()[i].grad())) << "param " << i;
  }
}

TEST(Errors, LossFnErrorKeepsItsTypeAndTheModelStaysUsable) {
  Fixture f;
  LossFn broken = [](const c10::IValue&, const c10::IValue&) -> c10::IValue {
    throw std::invalid_argument("loss_fn says no");
  };
  try {
    f.model.forward_backward({torch::randn({6, 4})}, make_kwargs(), c10::IValue(), broken, false, f.cfg);
    FAIL() << "expected loss_fn's error";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_THAT(msg, HasSubstr("loss_fn says no"));
    EXPECT_THAT(msg, HasSubstr("fused stage 0"));
    EXPECT_THAT(msg, HasSubstr("microbatch 0"));
  }
  at::Tensor loss = f.model.forward_backward({torch::randn({6, 4})}, make_kwargs(), c10::IValue(), f.loss_fn,
                                             false, f.cfg).toTensor();
  EXPECT_TRUE(loss.isfinite().item<bool>());
}

TEST(Errors, ErrorInForwardOnlyCallAndInBackwardOfForward) {
  Fixture f;
  at::Tensor bad = torch::randn({3, 4});
  bad[0][0] = 999;
  EXPECT_THROW(f.model.forward(bad, RunConfig().num_microbatch(1)), c10::ValueError);
  at::Tensor out = f.model.forward(torch::randn({3, 4}));
  out.sum().backward();  // still works
}

template <typename F>
void expect_value_error(F&& f, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "expected c10::ValueError containing '" << fragment << "'";
  } catch (const c10::ValueError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr(fragment));
  }
}

TEST(Errors, BadArgumentsGetClearValueErrors) {
  Fixture f;
  at::Tensor x = torch::randn({6, 4});
  auto fb = [&](const RunConfig& cfg) {
    f.model.forward_backward({x}, make_kwargs(), c10::IValue(), f.loss_fn, false, cfg);
  };
  expect_value_error([&] { fb(RunConfig().num_microbatch(0)); }, "num_microbatch must be >= 1, got 0");
  expect_value_error([&] { fb(RunConfig().execute_plan({{{0, 2}}, {}})); }, "backward");
  expect_value_error([&] { fb(RunConfig().execute_plan({{{0, 2}}, {{3, 4}, {2, 3}, {0, 2}}})); },
                     "forward plan must end exactly where the fused stage begins");
  expect_value_error([&] { fb(RunConfig().execute_plan({{{0, 2}, {2, 3}}, {{3, 4}, {1, 3}, {0, 2}}})); },
                     "exactly once");
  expect_value_error([&] { f.model.forward(x, RunConfig().execute_plan({{{0, 3}}, {}})); }, "last layer");
  expect_value_error([&] { f.model.forward_backward({x}, make_kwargs(), c10::IValue(), LossFn(), false, f.cfg); },
                     "loss_fn is empty");
  expect_value_error([&] { RoundPipe(f.net, RoundPipeOptions().set_max_devices(99)); }, "max_devices");
  expect_value_error([&] { RoundPipe(torch::nn::Sequential(), RoundPipeOptions()); }, "no layers");
  // Nothing above changed the model: a normal call still works.
  fb(f.cfg);
}

TEST(Errors, LayerThatIsNotCloneableIsRejectedClearly) {
  struct Plain : torch::nn::Module {
    at::Tensor forward(at::Tensor x) { return x; }
  };
  torch::nn::Sequential net(std::make_shared<Plain>());
  expect_value_error([&] { RoundPipe model(net); }, "cannot be cloned");
}

TEST(Errors, TensorLayerGivenATupleSaysWhatToDo) {
  torch::nn::Sequential net(torch::nn::Linear(2, 2));
  RoundPipe model(net);
  try {
    model.forward({torch::randn({2, 2}), torch::randn({2, 2})}, make_kwargs(), RunConfig().num_microbatch(1));
    FAIL();
  } catch (const c10::TypeError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("roundpipe::ValueLayer"));
  }
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
