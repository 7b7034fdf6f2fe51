// The benchmarks' block timing (bench/block_timing.h). Its reason to exist: a
// call that returns before its work is done (forward_backward with
// iterations overlapping) must not look faster than the same work done
// inline, as it did when one call and one baseline step were timed in turn.
// The work is sleeps on one shared "device" (as a GPU kernel keeps a device
// busy without a host core), so the comparison holds on a loaded machine.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../../bench/block_timing.h"  // the benchmarks' own header, tested here

namespace roundpipe {
namespace {

using std::chrono::milliseconds;

// Runs one piece of work at a time, whoever asks: the engine's background
// work and the baseline compete for it as they compete for cores.
class FakeDevice {
 public:
  void run(milliseconds d) {
    std::lock_guard<std::mutex> lock(mu_);
    std::this_thread::sleep_for(d);
  }

 private:
  std::mutex mu_;
};

// call() does its first part inline and returns; the rest runs on a
// background thread, as a call's backward stages do after it returned at
// its losses. synchronize() waits for all of it.
class EarlyReturningEngine {
 public:
  EarlyReturningEngine(FakeDevice& device, milliseconds front, milliseconds back)
      : device_(device), front_(front), back_(back), worker_([this] { loop(); }) {}
  ~EarlyReturningEngine() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  void call() {
    device_.run(front_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++queued_;
    }
    cv_.notify_all();
  }
  void synchronize() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return queued_ == 0; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || queued_ > 0; });
      if (queued_ == 0) return;  // stopped with nothing left
      lock.unlock();
      device_.run(back_);
      lock.lock();
      --queued_;
      cv_.notify_all();
    }
  }

  FakeDevice& device_;
  const milliseconds front_, back_;
  std::mutex mu_;
  std::condition_variable cv_;
  int queued_ = 0;
  bool stop_ = false;
  std::thread worker_;  // last: starts once the members it uses exist
};

TEST(BlockTiming, AnEarlyReturningCallIsNotFasterThanTheSameWorkInline) {
  const milliseconds front(4), back(12);
  FakeDevice device;
  EarlyReturningEngine engine(device, front, back);
  bench::BlockOptions opt;
  opt.warmup_rounds = 1;
  opt.rounds = 7;
  opt.steps_per_block = 4;
  auto early = [&] { engine.call(); };
  auto finish = [&] { engine.synchronize(); };
  auto inline_work = [&] {
    device.run(front);
    device.run(back);
  };
  const std::vector<bench::BlockTimes> t =
      bench::alternate_blocks({{"early", early, finish}, {"inline", inline_work, nullptr}}, opt);
  ASSERT_EQ(t.size(), 2u);
  // Sleeps last at least as long as asked and the device runs one at a
  // time: any block that includes the engine's work reads at least 16 ms
  // per call (timing the call alone read about 4).
  const double work_s = std::chrono::duration<double>(front + back).count();
  EXPECT_GE(t[0].median, work_s);
  EXPECT_GE(t[1].median, work_s);
  // Both measurements within 10 % (the early-returning side pays a thread
  // hand-off per call on top).
  EXPECT_NEAR(t[0].median / t[1].median, 1.0, 0.10)
      << "early " << t[0].median * 1e3 << " ms, inline " << t[1].median * 1e3 << " ms per call";
}

TEST(BlockTiming, BlocksAlternateAndOnlyTimedBlocksAreKept) {
  std::vector<std::string> order;
  int steps_a = 0, steps_b = 0, finishes_a = 0;
  bench::BlockOptions opt;
  opt.warmup_rounds = 1;
  opt.rounds = 5;
  opt.steps_per_block = 3;
  auto step_a = [&] {
    ++steps_a;
    order.push_back("a");
  };
  auto step_b = [&] {
    ++steps_b;
    order.push_back("b");
  };
  auto finish_a = [&] { ++finishes_a; };
  const std::vector<bench::BlockTimes> t =
      bench::alternate_blocks({{"a", step_a, finish_a}, {"b", step_b, nullptr}}, opt);
  EXPECT_EQ(steps_a, 18);
  EXPECT_EQ(steps_b, 18);
  EXPECT_EQ(finishes_a, 6);  // once per block, warm-up included
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].seconds_per_step.size(), 5u);
  EXPECT_EQ(t[1].seconds_per_step.size(), 5u);
  // Blocks of 3 steps; the side that starts a round rotates.
  ASSERT_EQ(order.size(), 36u);
  EXPECT_EQ(order[0], "a");
  EXPECT_EQ(order[3], "b");
  EXPECT_EQ(order[6], "b");
  EXPECT_EQ(order[9], "a");
}

}  // namespace
}  // namespace roundpipe
