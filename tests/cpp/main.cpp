// Test main: the engine tests run on four CPU virtual devices (models pick
// 1..4 of them with RoundPipeOptions::max_devices), each wrapped in a
// FaultInjectingDevice, so that tests of error handling can make its
// operations fail (DevicePool::fault_injecting_device); disarmed, a wrapper
// changes nothing.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "runtime/device_pool.h"

int main(int argc, char** argv) {
  setenv("ROUNDPIPE_DEVICES", "cpu:4", /*overwrite=*/0);
  roundpipe::DevicePool::wrap_devices_for_fault_injection();
  at::set_num_threads(1);  // results must not depend on intra-op threading
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
