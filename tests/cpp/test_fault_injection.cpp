// Failures injected into CPU virtual devices (uploads, downloads, allocations,
// layer computations, out of memory) at many points of a call: the error reaches the caller with
// its context, nothing is half-applied, and the model stays usable.
#include <gtest/gtest.h>
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

#include <iostream>
#include <string>
#include <vector>

#include "models.h"
#include "runtime/device.h"
#include "runtime/device_pool.h"
#include "runtime/fault_injecting_device.h"

namespace roundpipe {
namespace {

using testing::copy_of;
using testing::make_mlp;

// Device i of the pool, whose operations the tests make fail.
FaultInjectingDevice& faulty_device(int64_t i) {
  FaultInjectingDevice& dev = DevicePool::instance().fault_injecting_device(i);
  TORCH_CHECK(dynamic_cast<CpuDevice*>(&dev.wrapped()) != nullptr, "these tests need CPU virtual devices");
  return dev;
}

CpuDevice& cpu_device(int64_t i) { return dynamic_cast<CpuDevice&>(faulty_device(i).wrapped()); }

LossFn mse() { return testing::mse_loss_fn(); }

RunConfig config() {
  ModelExecutePlan plan;
  plan.fwd_plan = {{0, 3}, {3, 6}};
  plan.bwd_plan = {{6, 9}, {3, 6}, {0, 3}};
  return RunConfig().num_microbatch(3).execute_plan(plan);
}

std::vector<at::Tensor> grads(const torch::nn::Sequential& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return out;
}

void expect_same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << " " << i;
    if (a[i].defined()) {
      EXPECT_TRUE(a[i].equal(b[i])) << what << " " << i;
    }
  }
}

struct FaultCase {
  Fault fault;
  int64_t device;
  int64_t nth;
};

std::string name_of(const FaultCase& c) {
  const char* kind = c.fault == Fault::kUpload     ? "upload"
                     : c.fault == Fault::kDownload ? "download"
                     : c.fault == Fault::kCompute  ? "compute"
                                                   : "allocation";
  return std::string(kind) + "_dev" + std::to_string(c.device) + "_n" + std::to_string(c.nth);
}

std::vector<FaultCase> all_cases() {
  std::vector<FaultCase> out;
  for (Fault f : {Fault::kUpload, Fault::kDownload, Fault::kAllocation, Fault::kCompute}) {
    for (int64_t d : {0, 1}) {
      for (int64_t n : {1, 2, 3, 5, 8, 13, 21}) out.push_back({f, d, n});
    }
  }
  return out;
}

class InjectedFault : public ::testing::TestWithParam<FaultCase> {};

TEST_P(InjectedFault, ReachesTheCallerAndLeavesTheModelAsBefore) {
  const FaultCase c = GetParam();
  torch::manual_seed(5);
  torch::nn::Sequential net = make_mlp();
  torch::nn::Sequential twin_net = copy_of(net);
  RoundPipe model(net, RoundPipeOptions().set_max_devices(2).set_name("faulty"));
  RoundPipe twin(twin_net, RoundPipeOptions().set_max_devices(2));
  at::Tensor x0 = torch::randn({6, 16}), y0 = torch::randn({6, 4});
  at::Tensor x1 = torch::randn({6, 16}), y1 = torch::randn({6, 4});
  // Both models accumulate one call's gradients first.
  model.forward_backward({x0}, make_kwargs(), y0, mse(), false, config());
  twin.forward_backward({x0}, make_kwargs(), y0, mse(), false, config());
  model.synchronize();
  const std::vector<at::Tensor> before = grads(net);

  // Device indices of the pool: the model uses the first two.
  faulty_device(c.device).inject_fault(c.fault, c.nth);
  bool failed = false;
  try {
    model.forward_backward({x1}, make_kwargs(), y1, mse(), false, config());
  } catch (const c10::Error& e) {
    failed = true;
    const std::string msg = e.what();
    EXPECT_NE(msg.find("injected fault"), std::string::npos) << msg;
    EXPECT_NE(msg.find("RoundPipe model 'faulty'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cpu:" + std::to_string(c.device)), std::string::npos) << msg;
  }
  faulty_device(c.device).inject_fault(c.fault, 0);
  if (!failed) GTEST_SKIP() << "the call made fewer than " << c.nth << " such operations on that device";
  model.synchronize();
  expect_same(grads(net), before, "gradients after the failed call");

  // Usable again: the same call now gives what a model that never failed gives.
  model.forward_backward({x1}, make_kwargs(), y1, mse(), false, config());
  twin.forward_backward({x1}, make_kwargs(), y1, mse(), false, config());
  model.synchronize();
  twin.synchronize();
  expect_same(grads(net), grads(twin_net), "gradients after the retry");
}

INSTANTIATE_TEST_SUITE_P(Points, InjectedFault, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return name_of(info.param); });

// Guards the sweep above: for every kind and device, which of the sweep's
// points fire. Each (kind, device) fires at the first point, the points that
// fire are a prefix of the sweep's (the call makes so many such operations),
// and the sweep skips exactly the points past that prefix.
TEST(InjectedFault, EveryKindFailsOnEveryDeviceAndTheSweepSkipsOnlyPastTheLastOperation) {
  int skipped = 0;
  for (Fault f : {Fault::kUpload, Fault::kDownload, Fault::kAllocation, Fault::kCompute}) {
    for (int64_t d : {0, 1}) {
      std::vector<int64_t> fired;
      bool stopped = false;
      for (int64_t n : {1, 2, 3, 5, 8, 13, 21}) {
        RoundPipe model(make_mlp(), RoundPipeOptions().set_max_devices(2));
        faulty_device(d).inject_fault(f, n);
        bool failed = false;
        try {
          model.forward_backward({torch::randn({6, 16})}, make_kwargs(), torch::randn({6, 4}), mse(), false,
                                 config());
          model.synchronize();  // a failure after the losses is raised here
        } catch (const c10::Error&) {
          failed = true;
        }
        faulty_device(d).inject_fault(f, 0);
        const std::string point = name_of({f, d, n});
        if (failed) {
          EXPECT_FALSE(stopped) << point << " fired after a smaller point did not";
          fired.push_back(n);
        } else {
          stopped = true;
          ++skipped;
        }
      }
      EXPECT_FALSE(fired.empty()) << name_of({f, d, 1}) << ": no fault fired on this device";
      std::cout << "[ fault sweep ] " << name_of({f, d, 1}).substr(0, name_of({f, d, 1}).size() - 3)
                << ": " << fired.size() << " of 7 points fire\n";
    }
  }
  std::cout << "[ fault sweep ] " << skipped << " of 56 points are past the call's last such operation\n";
}

// One slow device (every layer computation 3 ms late) changes timing, not
// results: losses and parameters stay bitwise those of a twin trained first on
// undelayed devices, with async steps in flight, and the model is destroyed
// with work queued.
TEST(SlowDevice, ChangesTimingNotResults) {
  torch::manual_seed(9);
  torch::nn::Sequential net = make_mlp();
  torch::nn::Sequential twin_net = copy_of(net);
  std::vector<at::Tensor> xs, ys;
  for (int step = 0; step < 4; ++step) {
    xs.push_back(torch::randn({6, 16}));
    ys.push_back(torch::randn({6, 4}));
  }
  std::vector<at::Tensor> twin_losses;
  {
    RoundPipe twin(twin_net, RoundPipeOptions().set_max_devices(2));
    torch::optim::SGD twin_opt(twin.optim_parameters(), torch::optim::SGDOptions(0.05));
    for (int step = 0; step < 4; ++step) {
      twin_losses.push_back(
          twin.forward_backward({xs[step]}, make_kwargs(), ys[step], mse(), false, config()).toTensor());
      twin.step([&] {
        twin_opt.step();
        twin_opt.zero_grad();
      });
    }
    twin.synchronize();
  }
  faulty_device(1).set_layer_delay(std::chrono::milliseconds(3));
  {
    // A pointer, so the model can go before the optimizer its last step uses.
    auto owned = std::make_unique<RoundPipe>(net, RoundPipeOptions().set_max_devices(2));
    RoundPipe& model = *owned;
    torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.05));
    for (int step = 0; step < 4; ++step) {
      at::Tensor a = model.forward_backward({xs[step]}, make_kwargs(), ys[step], mse(), false, config()).toTensor();
      EXPECT_TRUE(a.equal(twin_losses[step])) << "loss of step " << step;
      model.step([&] {
        opt.step();
        opt.zero_grad();
      });
    }
    model.synchronize();
    for (size_t i = 0; i < net->parameters().size(); ++i) {
      EXPECT_TRUE(net->parameters()[i].equal(twin_net->parameters()[i])) << "parameter " << i;
    }
    model.forward_backward({torch::randn({6, 16})}, make_kwargs(), torch::randn({6, 4}), mse(), false,
                           config());
    model.step([&] { opt.step(); });
    owned.reset();  // destroyed with a step in flight on a slow device (it runs first)
  }
  faulty_device(1).set_layer_delay(std::chrono::microseconds(0));
}

// The test binary's pool wraps every device (tests/cpp/main.cpp): each
// wrapper has its device's place and name, and a pool made already cannot be
// asked to wrap.
TEST(FaultInjectingDevice, WrapsEachDeviceOfThePoolOnlyWhenAskedBeforeThePoolIsMade) {
  DevicePool& pool = DevicePool::instance();
  for (int64_t i = 0; i < pool.size(); ++i) {
    FaultInjectingDevice& wrapper = pool.fault_injecting_device(i);
    EXPECT_EQ(&wrapper, &pool.device(i));
    EXPECT_EQ(wrapper.index(), wrapper.wrapped().index());
    EXPECT_EQ(wrapper.name(), wrapper.wrapped().name());
  }
  EXPECT_THROW(DevicePool::wrap_devices_for_fault_injection(), c10::Error);
}

TEST(OutOfMemory, ADeviceOverItsCapacityFailsClearlyAndRecovers) {
  torch::manual_seed(2);
  RoundPipe model(make_mlp(64, 2), RoundPipeOptions().set_max_devices(2).set_name("big"));
  cpu_device(0).set_memory_capacity(4096);  // smaller than one stage's parameters
  cpu_device(1).set_memory_capacity(4096);
  try {
    model.forward(torch::randn({8, 64}));
    ADD_FAILURE() << "expected an out-of-memory error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("out of memory"), std::string::npos) << msg;
    EXPECT_NE(msg.find("RoundPipe model 'big'"), std::string::npos) << msg;
  }
  cpu_device(0).set_memory_capacity(0);
  cpu_device(1).set_memory_capacity(0);
  EXPECT_NO_THROW(model.forward(torch::randn({8, 64})));
}

}  // namespace
}  // namespace roundpipe
