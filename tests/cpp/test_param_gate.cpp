// ParamGate: calls wait, layer by layer, for the optimizer -> model copy.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "engine/param_gate.h"

namespace roundpipe {
namespace {

TEST(ParamGate, ALayerIsReleasedAsSoonAsItIsWritten) {
  ParamGate gate(3);
  EXPECT_EQ(gate.issued(), 0);
  gate.wait_all(0);  // nothing issued: nothing to wait for
  const int64_t g = gate.begin_write();
  EXPECT_EQ(g, 1);
  std::atomic<int> reached{0};
  std::thread reader([&] {
    gate.wait(0, g);
    reached = 1;
    gate.wait(2, g);
    reached = 2;
  });
  gate.mark_written(0, g);
  while (reached.load() < 1) std::this_thread::yield();  // layer 0 alone releases the first wait
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(reached.load(), 1);  // layer 2 is not written yet
  gate.mark_written(1, g);
  gate.mark_written(2, g);
  reader.join();
  EXPECT_EQ(reached.load(), 2);
}

TEST(ParamGate, LaterWritesSatisfyEarlierGenerationsAndFailuresReleaseAll) {
  ParamGate gate(2);
  const int64_t g1 = gate.begin_write();
  const int64_t g2 = gate.begin_write();
  EXPECT_EQ(gate.issued(), g2);
  gate.mark_all_written(g2);  // e.g. a failed write still releases every layer
  gate.wait_all(g1);
  gate.wait_all(g2);
  gate.mark_written(0, g1);  // an older mark never moves a layer back
  std::thread reader([&] { gate.wait(0, g2); });
  reader.join();
}

}  // namespace
}  // namespace roundpipe
