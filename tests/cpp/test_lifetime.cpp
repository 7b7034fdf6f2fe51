// Who destroys what (docs/design/engine.md): a model whose last owner lets
// go on its own optimizer thread (a step_fn that holds the model) or on a
// device worker (a layer of another model) is destroyed elsewhere, never by a
// thread joining itself; a model dropped with its asynchronous step in flight
// finishes that step first; the destruction does happen; forward()'s autograd
// graph keeps the engine alive for backward.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <memory>
#include <thread>

#include "engine/engine_access.h"
#include "engine/layer_handle.h"
#include "engine/lifetime.h"
#include "models.h"
#include "util/worker_thread.h"

namespace roundpipe {
namespace {

using testing::make_mlp;
using testing::mse_loss_fn;

struct DropCase {
  bool is_async;
  int64_t devices;
};

class ModelDroppedOnItsOptimizerThread : public ::testing::TestWithParam<DropCase> {};

// 1,000 short-lived models whose step_fn holds the model, dropped by the
// caller after step (the step_fn's release is the last) or by the step_fn
// itself: the process must neither abort nor hang.
TEST_P(ModelDroppedOnItsOptimizerThread, ThousandTimesWithoutAbort) {
  const DropCase c = GetParam();
  at::Tensor x = torch::randn({4, 16}), y = torch::randn({4, 4});
  for (int i = 0; i < 1000; ++i) {
    auto model =
        std::make_shared<RoundPipe>(make_mlp(16, 1), RoundPipeOptions().set_max_devices(c.devices));
    model->forward_backward({x}, make_kwargs(), y, mse_loss_fn());
    if (i % 2 == 0) {
      // After: the step_fn holds the last reference once the caller lets go.
      model->step([model] { (void)model->parameters(); }, c.is_async);
      model.reset();
    } else {
      // Inside: the step_fn drops its reference while it runs, the last one
      // once the caller let go (the caller holds its own during step).
      auto holder = std::make_shared<std::shared_ptr<RoundPipe>>(model);
      model->step([holder] { holder->reset(); }, c.is_async);
      model.reset();
    }
  }
  wait_for_pending_destructions();
}

INSTANTIATE_TEST_SUITE_P(Lifetime, ModelDroppedOnItsOptimizerThread,
                         ::testing::Values(DropCase{true, 1}, DropCase{true, 2}, DropCase{false, 1},
                                           DropCase{false, 2}),
                         [](const auto& info) {
                           return std::string(info.param.is_async ? "Async" : "Sync") +
                                  std::to_string(info.param.devices) + "Devices";
                         });

// A linear layer whose lifetime the test can observe; it runs `on_forward`
// (if any) before each forward, on whichever device worker runs it.
class WatchedLayer final : public LayerHandle {
 public:
  explicit WatchedLayer(torch::nn::Linear linear, std::function<void()> on_forward = {})
      : inner_(make_module_layer(torch::nn::AnyModule(linear), 0)), on_forward_(std::move(on_forward)) {}
  std::string type_name() const override { return "WatchedLayer"; }
  NamedTensors named_parameters() const override { return inner_->named_parameters(); }
  NamedTensors named_buffers() const override { return inner_->named_buffers(); }
  bool is_training() const override { return inner_->is_training(); }
  void train(bool on) override { inner_->train(on); }
  std::vector<at::Tensor> bind(int replica, const std::vector<at::Tensor>& params,
                               const std::vector<at::Tensor>& buffers) override {
    return inner_->bind(replica, params, buffers);
  }
  std::vector<at::Tensor> bound_buffers(int replica) override {
    return inner_->bound_buffers(replica);
  }
  c10::IValue forward(int replica, std::vector<c10::IValue> args, Kwargs kwargs) override {
    if (on_forward_) on_forward_();
    return inner_->forward(replica, std::move(args), std::move(kwargs));
  }
  void unbind(int replica) override { inner_->unbind(replica); }

 private:
  std::shared_ptr<LayerHandle> inner_;
  std::function<void()> on_forward_;
};

// A model whose asynchronous step is still running (`step_body`), with a
// layer the test watches.
struct ModelInFlight {
  std::shared_ptr<RoundPipe> model;
  std::weak_ptr<LayerHandle> watch;
};

ModelInFlight model_with_a_step_in_flight(int64_t devices, std::function<void()> step_body) {
  auto layer = std::make_shared<WatchedLayer>(torch::nn::Linear(4, 4));
  ModelInFlight m{std::make_shared<RoundPipe>(detail::EngineAccess::from_layers(
                      {layer, std::make_shared<WatchedLayer>(torch::nn::Linear(4, 4))},
                      RoundPipeOptions().set_max_devices(devices))),
                  layer};
  m.model->forward_backward({torch::randn({6, 4})}, make_kwargs(), torch::randn({6, 4}),
                            mse_loss_fn());
  m.model->step(std::move(step_body), /*is_async=*/true);
  return m;
}

void expect_destroyed_soon(const std::weak_ptr<LayerHandle>& watch) {
  for (int i = 0; i < 2000 && !watch.expired(); ++i) {
    wait_for_pending_destructions();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(watch.expired());
}

class ModelDroppedWithWorkInFlight : public ::testing::TestWithParam<int64_t> {};

// The caller lets go while the step runs: the destruction waits for the
// step, which completes (it is not cut short), and the model is gone at once.
TEST_P(ModelDroppedWithWorkInFlight, OnTheUserThread) {
  std::atomic<int> steps_done{0};
  for (int i = 0; i < 5; ++i) {
    ModelInFlight m = model_with_a_step_in_flight(GetParam(), [&steps_done] {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      steps_done.fetch_add(1);
    });
    m.model.reset();
    EXPECT_EQ(steps_done.load(), i + 1);
    EXPECT_TRUE(m.watch.expired());
  }
}

// The last reference is held by a layer of another model and dropped on the
// device worker running that layer, while the dropped model's step waits for
// that very drop: destroying in place (joining the optimizer thread there)
// would block the worker on a step that cannot finish until the worker moves
// on. The reaper destroys it instead; both models' work completes.
TEST_P(ModelDroppedWithWorkInFlight, OnADeviceWorkerOfAnotherModel) {
  std::atomic<int> steps_done{0};
  for (int i = 0; i < 5; ++i) {
    auto dropped = std::make_shared<std::atomic<bool>>(false);
    ModelInFlight m = model_with_a_step_in_flight(GetParam(), [dropped, &steps_done] {
      // Bounded, so that a regression fails the checks below instead of hanging.
      for (int t = 0; t < 5000 && !dropped->load(); ++t) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      steps_done.fetch_add(1);
    });
    auto holder = std::make_shared<std::shared_ptr<RoundPipe>>(std::move(m.model));
    bool destroyed_on_the_worker = true;
    const std::weak_ptr<LayerHandle> watch = m.watch;
    RoundPipe other = detail::EngineAccess::from_layers(
        {std::make_shared<WatchedLayer>(torch::nn::Linear(4, 4),
                                        [holder, dropped, watch, &destroyed_on_the_worker] {
                                          if (dropped->load()) return;  // a later microbatch
                                          holder->reset();
                                          destroyed_on_the_worker = watch.expired();
                                          dropped->store(true);
                                        })},
        RoundPipeOptions().set_max_devices(GetParam()));
    at::Tensor loss = other.forward_backward({torch::randn({6, 4})}, make_kwargs(),
                                             torch::randn({6, 4}), mse_loss_fn())
                          .toTensor();
    EXPECT_TRUE(dropped->load());
    EXPECT_FALSE(destroyed_on_the_worker);
    EXPECT_TRUE(std::isfinite(loss.item<float>()));
    expect_destroyed_soon(m.watch);
  }
  EXPECT_EQ(steps_done.load(), 5);
}

INSTANTIATE_TEST_SUITE_P(Lifetime, ModelDroppedWithWorkInFlight, ::testing::Values(1, 2),
                         [](const auto& info) { return std::to_string(info.param) + "Devices"; });

TEST(Lifetime, AModelReleasedOnItsOptimizerThreadIsStillDestroyed) {
  auto layer = std::make_shared<WatchedLayer>(torch::nn::Linear(4, 4));
  std::weak_ptr<LayerHandle> watch = layer;
  auto model =
      std::make_shared<RoundPipe>(detail::EngineAccess::from_layers({layer}, RoundPipeOptions()));
  layer.reset();
  model->forward_backward({torch::randn({6, 4})}, make_kwargs(), torch::randn({6, 4}),
                          mse_loss_fn());
  model->step([model] {}, /*is_async=*/true);
  model.reset();
  // The reaper runs after the optimizer thread let go, which may release the
  // step_fn just after a wait was queued.
  expect_destroyed_soon(watch);
}

TEST(Lifetime, BackwardAfterTheModelWasDroppedUsesTheEngineTheGraphHolds) {
  torch::nn::Sequential net = make_mlp(8, 2, 3);
  torch::nn::Sequential reference = testing::copy_of(net);
  at::Tensor x = torch::randn({6, 8});
  at::Tensor x_ref = x.clone().requires_grad_(true);
  x.requires_grad_(true);
  at::Tensor out;
  {
    RoundPipe model(net, RoundPipeOptions().set_max_devices(2));
    out = model.forward(x);
    model.step([] {}, /*is_async=*/true);
  }  // the model is gone; its engine lives on in out's graph
  out.pow(2).sum().backward();
  reference->forward(x_ref).pow(2).sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), 1e-5, 1e-6));
  out = at::Tensor();  // the engine's last owner: destroyed here
}

// Destroying a model can hand on another (its optimizer thread's last task
// drops a second model): waiting at exit covers the second too, else it would
// run while the embedding tears down what it needs.
TEST(Lifetime, WaitingForPendingDestructionsWaitsForTheOnesTheyHandOn) {
  std::atomic<bool> second_done{false};
  std::promise<void> handed_over;
  WorkerThread engine_thread;  // an engine thread may not destroy: it hands over
  engine_thread.post([&] {
    destroy_where_allowed([&second_done] {
      // Long enough that the caller waits while this one runs.
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      destroy_where_allowed([&second_done] { second_done.store(true); });
    });
    handed_over.set_value();
  });
  handed_over.get_future().wait();
  wait_for_pending_destructions();
  EXPECT_TRUE(second_done.load());
}

}  // namespace
}  // namespace roundpipe
