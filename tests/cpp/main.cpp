// Test main: the engine tests run on four CPU virtual devices (models pick
// 1..4 of them with RoundPipeOptions::max_devices).
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>

int main(int argc, char** argv) {
  setenv("ROUNDPIPE_DEVICES", "cpu:4", /*overwrite=*/0);
  at::set_num_threads(1);  // results must not depend on intra-op threading
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
