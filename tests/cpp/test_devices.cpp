// ROUNDPIPE_DEVICES parsing and the device pool.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <roundpipe/devices.h>
#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdlib>
#include <future>
#include <thread>

#include "copy_delay.h"
#include "runtime/device_pool.h"

namespace roundpipe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(DeviceSpec, AcceptedForms) {
  EXPECT_THAT(DevicePool::parse_spec("cpu:3", 0), ElementsAre("cpu:0", "cpu:1", "cpu:2"));
  EXPECT_THAT(DevicePool::parse_spec("cuda", 2), ElementsAre("cuda:0", "cuda:1"));
  EXPECT_THAT(DevicePool::parse_spec("cuda:0,2", 3), ElementsAre("cuda:0", "cuda:2"));
  // Several devices over one GPU, each with its own streams.
  EXPECT_THAT(DevicePool::parse_spec("cuda:0,cuda:0", 1), ElementsAre("cuda:0", "cuda:0"));
  EXPECT_THAT(DevicePool::parse_spec("cuda:1,1", 2), ElementsAre("cuda:1", "cuda:1"));
  EXPECT_THAT(DevicePool::parse_spec("cuda:0x3,1", 2), ElementsAre("cuda:0", "cuda:0", "cuda:0", "cuda:1"));
}

TEST(DeviceSpec, BadFormsSayWhatIsAccepted) {
  for (const char* bad : {"cpu:0", "cpu:x", "cpu:", "gpu", "cuda:0x0", "cuda:0x9", "cuda:0x", "cuda:x2", "cuda:5", "cuda:", "cpu:-1"}) {
    try {
      DevicePool::parse_spec(bad, 2);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const c10::ValueError& e) {
      EXPECT_THAT(std::string(e.what()), HasSubstr("ROUNDPIPE_DEVICES")) << bad;
    }
  }
  EXPECT_THROW(DevicePool::parse_spec("cuda", 0), c10::ValueError);
}

TEST(DevicePool, UsesTheEnvironmentAndReportsMemoryPerDevice) {
  EXPECT_EQ(get_num_devices(), 4);  // the test main selects cpu:4
  EXPECT_THAT(get_device_names(), ElementsAre("cpu:0", "cpu:1", "cpu:2", "cpu:3"));
  auto stats = device_memory_stats();
  ASSERT_EQ(stats.size(), 4u);
  // Work submitted to a device is charged to it, and freed memory is returned.
  Device& dev = DevicePool::instance().device(1);
  const int64_t before = dev.memory_allocated();
  std::promise<int64_t> during;
  dev.submit([&] {
    at::Tensor t = at::empty({1 << 20}, at::kByte);
    during.set_value(dev.memory_allocated());
  });
  EXPECT_GE(during.get_future().get(), before + (1 << 20));
  std::promise<void> done;
  dev.submit([&] { done.set_value(); });
  done.get_future().wait();
  EXPECT_EQ(dev.memory_allocated(), before);
  EXPECT_GE(dev.max_memory_allocated(), before + (1 << 20));
}

// Runs `fn` on device `dev`'s worker and waits for it.
template <typename F>
void on_worker(Device& dev, F fn) {
  std::promise<void> done;
  dev.submit([&] {
    fn();
    done.set_value();
  });
  done.get_future().wait();
}

// A host condition that the test opens (as the optimizer opens its
// parameter gate).
class ManualFence final : public Fence {
 public:
  void open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void synchronize() const override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }
  bool query() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return open_;
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool open_ = false;
};

// An upload behind a closed gate: the parameter-upload lane waits, the
// worker goes on (it finishes its task and runs the next), and the upload
// completes once the gate opens.
void expect_a_gated_upload_leaves_the_worker_free(Device& dev) {
  auto gate = std::make_shared<ManualFence>();
  const at::Tensor host = at::arange(1 << 16, at::kFloat);
  at::Tensor up;
  FencePtr uploaded;
  std::promise<void> issued, next;
  dev.submit([&] {
    dev.lane_wait(Lane::kParamUpload, gate);
    up = dev.upload({host}, Lane::kParamUpload, nullptr)[0];
    uploaded = dev.lane_fence(Lane::kParamUpload);
    issued.set_value();
  });
  dev.submit([&] { next.set_value(); });
  const bool worker_free = next.get_future().wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  const bool completed_early = worker_free && uploaded->query();
  gate->open();  // before any assertion: a blocked worker must not hang the suite
  issued.get_future().wait();
  EXPECT_TRUE(worker_free) << "the worker waited for the gate";
  EXPECT_FALSE(completed_early) << "the upload completed before its gate opened";
  uploaded->synchronize();
  EXPECT_TRUE(up.cpu().equal(host));
}

TEST(CpuDeviceLanes, AGatedUploadWaitsOnItsLaneNotOnTheWorker) {
  if (get_device_names().front().rfind("cpu", 0) != 0) GTEST_SKIP() << "the Gpu test of the same name";
  expect_a_gated_upload_leaves_the_worker_free(DevicePool::instance().device(0));
}

TEST(Gpu, AGatedUploadWaitsOnItsLaneNotOnTheWorker) {
  if (get_device_names().front().rfind("cuda", 0) != 0) GTEST_SKIP() << "needs ROUNDPIPE_DEVICES=cuda";
  expect_a_gated_upload_leaves_the_worker_free(DevicePool::instance().device(0));
}

TEST(CpuDeviceLanes, ACopyCompletesLateAndReadsAsNaNUntilItsFence) {
  testing::CopyDelay delay(100000);
  Device& dev = DevicePool::instance().device(0);
  at::Tensor host = at::arange(8, at::kFloat);
  on_worker(dev, [&] {
    const auto issued = std::chrono::steady_clock::now();
    at::Tensor up = dev.upload({host}, Lane::kParamUpload, nullptr)[0];
    FencePtr fence = dev.lane_fence(Lane::kParamUpload);
    EXPECT_TRUE(up.isnan().all().item<bool>()) << "read before its copy completed";
    fence->synchronize();
    EXPECT_GE(std::chrono::steady_clock::now() - issued, std::chrono::microseconds(100000));
    EXPECT_TRUE(up.equal(host));
    // A download also completes at its lane's next fence, not before.
    at::Tensor down = dev.download({up * 2})[0];
    EXPECT_TRUE(down.isnan().all().item<bool>());
    dev.lane_fence(Lane::kDownload)->synchronize();
    EXPECT_TRUE(down.equal(host * 2));
  });
}

TEST(CpuDeviceLanes, ADownloadPutsSmallTensorsOfADtypeInOneHostBufferEachATensorOfItsOwn) {
  testing::CopyDelay delay(2000);
  Device& dev = DevicePool::instance().device(0);
  at::Tensor a = at::randn({4, 3}), b = at::randn({3, 5}).t(), ids = at::arange(6, at::kLong);
  std::vector<at::Tensor> down;
  on_worker(dev, [&] {
    down = dev.download({a, ids, b});
    EXPECT_TRUE(down[0].isnan().all().item<bool>()) << "read before its copy completed";
    dev.lane_fence(Lane::kDownload)->synchronize();
  });
  EXPECT_TRUE(down[0].equal(a));
  EXPECT_TRUE(down[1].equal(ids));
  EXPECT_TRUE(down[2].equal(b));
  EXPECT_TRUE(down[2].is_contiguous());
  EXPECT_TRUE(down[0].storage().is_alias_of(down[2].storage()));
  down[0].zero_();
  EXPECT_TRUE(down[2].equal(b));
}

TEST(CpuDeviceLanes, LanesRunInIssueOrderAndAnUploadWaitsForItsAfterFence) {
  testing::CopyDelay delay(2000);
  Device& a = DevicePool::instance().device(0);
  Device& b = DevicePool::instance().device(1);
  at::Tensor host = at::randn({64});
  at::Tensor on_a, from_a, on_b;
  FencePtr downloaded;
  on_worker(a, [&] {
    on_a = a.upload({host}, Lane::kActUpload, nullptr)[0];
    a.compute_wait(a.lane_fence(Lane::kActUpload));
    from_a = a.download({on_a + 1})[0];
    downloaded = a.lane_fence(Lane::kDownload);
  });
  on_worker(b, [&] {
    on_b = b.upload({from_a}, Lane::kActUpload, downloaded)[0];  // waits for a's download on its lane
    b.lane_fence(Lane::kActUpload)->synchronize();
  });
  EXPECT_TRUE(on_b.equal(host + 1));
}

TEST(CpuDeviceLanes, MemoryIsChargedUntilTheFenceOfItsLastUse) {
  testing::CopyDelay delay(100000);
  Device& dev = DevicePool::instance().device(2);
  on_worker(dev, [&] {
    const int64_t before = dev.memory_allocated();
    FencePtr fence;
    {
      at::Tensor t = at::ones({1 << 18}, at::kFloat);  // 1 MiB of device memory
      dev.download({t});
      fence = dev.lane_fence(Lane::kDownload);
    }  // dropped by the worker while its download is still pending
    EXPECT_GE(dev.memory_allocated(), before + (4 << 18)) << "freed before its last use completed";
    fence->synchronize();
    EXPECT_EQ(dev.memory_allocated(), before);
  });
}

TEST(CpuDeviceLanes, TheCopyDelayVariableIsValidated) {
  ASSERT_EQ(setenv("ROUNDPIPE_CPU_COPY_DELAY_US", "250", 1), 0);
  EXPECT_EQ(cpu_copy_delay_from_env(), std::chrono::microseconds(250));
  for (const char* bad : {"-1", "fast", "10ms", "99999999999"}) {
    ASSERT_EQ(setenv("ROUNDPIPE_CPU_COPY_DELAY_US", bad, 1), 0);
    try {
      cpu_copy_delay_from_env();
      ADD_FAILURE() << bad << " was accepted";
    } catch (const c10::ValueError& e) {
      EXPECT_THAT(std::string(e.what()), HasSubstr("ROUNDPIPE_CPU_COPY_DELAY_US")) << bad;
    }
  }
  unsetenv("ROUNDPIPE_CPU_COPY_DELAY_US");
  EXPECT_EQ(cpu_copy_delay_from_env(), std::chrono::microseconds(0));
}

}  // namespace
}  // namespace roundpipe
