// ROUNDPIPE_DEVICES parsing and the device pool.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <roundpipe/devices.h>
#include <ATen/ATen.h>

#include <future>

#include "runtime/device_pool.h"

namespace roundpipe {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(DeviceSpec, AcceptedForms) {
  EXPECT_THAT(DevicePool::parse_spec("cpu:3", 0), ElementsAre("cpu:0", "cpu:1", "cpu:2"));
  EXPECT_THAT(DevicePool::parse_spec("cuda", 2), ElementsAre("cuda:0", "cuda:1"));
  EXPECT_THAT(DevicePool::parse_spec("cuda:0,2", 3), ElementsAre("cuda:0", "cuda:2"));
}

TEST(DeviceSpec, BadFormsSayWhatIsAccepted) {
  for (const char* bad : {"cpu:0", "cpu:x", "cpu:", "gpu", "cuda:1,1", "cuda:5", "cuda:", "cpu:-1"}) {
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

}  // namespace
}  // namespace roundpipe
