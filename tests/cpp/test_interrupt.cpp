// Interrupted waits (util/interrupt.h, what Ctrl-C does in Python): a call
// whose waiting thread is interrupted is cancelled like a failed call
// (nothing of it kept, the model usable, the interrupt's exception reaches the
// caller unchanged), an interrupted synchronize stops waiting while the
// queued step still runs once, and a scope ends with its thread's block.
#include <gtest/gtest.h>
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "models.h"
#include "runtime/device.h"
#include "runtime/device_pool.h"
#include "runtime/fault_injecting_device.h"
#include "util/interrupt.h"

namespace roundpipe {
namespace {

using Clock = std::chrono::steady_clock;
using testing::copy_of;
using testing::make_mlp;

struct Interrupt : std::runtime_error {
  Interrupt() : std::runtime_error("interrupt") {}
};

// Device i of the pool, which the tests make slow.
FaultInjectingDevice& slow_device(int64_t i) {
  FaultInjectingDevice& dev = DevicePool::instance().fault_injecting_device(i);
  TORCH_CHECK(dynamic_cast<CpuDevice*>(&dev.wrapped()) != nullptr, "these tests need CPU virtual devices");
  return dev;
}

// A poll that interrupts once `after` has passed since the scope began.
InterruptPoll interrupt_after(std::chrono::milliseconds after, Clock::time_point* fired) {
  const auto start = Clock::now();
  return [=]() -> std::exception_ptr {
    if (Clock::now() - start < after) return nullptr;
    *fired = Clock::now();
    return std::make_exception_ptr(Interrupt());
  };
}

RunConfig eight() { return RunConfig().num_microbatch(8); }

TEST(Interrupt, CancelsACallLikeAFailureAndTheModelStaysUsable) {
  torch::manual_seed(3);
  torch::nn::Sequential net = make_mlp(), twin_net = copy_of(net);
  RoundPipe model(net, RoundPipeOptions().set_max_devices(2)), twin(twin_net, RoundPipeOptions().set_max_devices(2));
  const at::Tensor x = torch::randn({8, 16}), y = torch::randn({8, 4});
  for (int64_t d : {0, 1}) slow_device(d).set_layer_delay(std::chrono::milliseconds(20));
  Clock::time_point fired;
  {
    InterruptScope scope(interrupt_after(std::chrono::milliseconds(100), &fired));
    EXPECT_THROW(model.forward_backward({x}, make_kwargs(), y, testing::mse_loss_fn(), false, eight()), Interrupt);
  }
  const double late_s = std::chrono::duration<double>(Clock::now() - fired).count();
  EXPECT_LT(late_s, 1.0) << "the call ended " << late_s << " s after the interrupt";
  for (int64_t d : {0, 1}) slow_device(d).set_layer_delay(std::chrono::microseconds(0));
  model.synchronize();
  for (const auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined()) << "a gradient was kept";
  const at::Tensor a = model.forward_backward({x}, make_kwargs(), y, testing::mse_loss_fn(), false, eight()).toTensor();
  const at::Tensor b = twin.forward_backward({x}, make_kwargs(), y, testing::mse_loss_fn(), false, eight()).toTensor();
  EXPECT_TRUE(a.equal(b));
  model.synchronize();
  twin.synchronize();
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(net->parameters()[i].grad().equal(twin_net->parameters()[i].grad())) << "grad " << i;
  }
}

TEST(Interrupt, SynchronizeStopsWaitingAndTheQueuedStepRunsOnce) {
  RoundPipe model(make_mlp(), RoundPipeOptions().set_max_devices(2));
  std::atomic<int> steps{0};
  model.step([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    ++steps;
  });
  Clock::time_point fired;
  {
    InterruptScope scope(interrupt_after(std::chrono::milliseconds(50), &fired));
    EXPECT_THROW(model.synchronize(), Interrupt);
  }
  EXPECT_EQ(steps.load(), 0) << "synchronize waited for the step";
  model.synchronize();
  EXPECT_EQ(steps.load(), 1);
}

TEST(Interrupt, WithoutAScopeNothingPolls) {
  EXPECT_FALSE(interruptible());
  EXPECT_EQ(poll_interrupt(), nullptr);
  {
    InterruptScope scope([]() -> std::exception_ptr { return nullptr; });
    EXPECT_TRUE(interruptible());
    RoundPipe model(make_mlp(), RoundPipeOptions().set_max_devices(2));
    model.forward_backward({torch::randn({8, 16})}, make_kwargs(), torch::randn({8, 4}), testing::mse_loss_fn(),
                           false, eight());  // polled while it waits, never interrupted
  }
  EXPECT_FALSE(interruptible());
}

}  // namespace
}  // namespace roundpipe
