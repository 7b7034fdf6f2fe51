// Countdown: the waiter may free it as soon as the last task finished; the
// last finish() must be done with it by then. (Also built with
// ThreadSanitizer by scripts/tsan --primitives, which reports a use of the
// freed condition variable if finish() notified after unlocking.)
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "util/countdown.h"

namespace roundpipe {
namespace {

TEST(Countdown, WaitReturnsOnceEveryTaskFinished) {
  Countdown done;
  std::vector<std::thread> tasks;
  for (int i = 0; i < 4; ++i) tasks.emplace_back([&] { done.finish(); });
  done.wait_for(4);
  for (auto& t : tasks) t.join();
  done.wait_for(0);  // nothing to wait for
}

TEST(Countdown, TheWaiterMayFreeItRightAfterTheLastFinish) {
  // As a call and its jobs: the workers do not own the countdown, the
  // waiter frees it the moment wait_for returns.
  for (int round = 0; round < 2000; ++round) {
    auto* done = new Countdown();
    const int workers = 1 + round % 3;
    std::vector<std::thread> tasks;
    for (int i = 0; i < workers; ++i) tasks.emplace_back([done] { done->finish(); });
    done->wait_for(workers);
    delete done;
    for (auto& t : tasks) t.join();
  }
}

TEST(Countdown, WaitersForDifferentCountsEachReturnAtTheirOwn) {
  // finish() wakes only at the smallest count waited for: a waiter for a
  // larger one must still be woken later.
  for (int round = 0; round < 200; ++round) {
    Countdown done;
    std::atomic<int> returned{0};
    std::thread two([&] { done.wait_for(2); returned |= 1; });
    std::thread four([&] { done.wait_for(4); returned |= 2; });
    for (int i = 0; i < 4; ++i) {
      if (i == 2 + round % 2) {
        while (!(returned.load() & 1)) std::this_thread::yield();  // the waiter for 2 returned after 2
      }
      done.finish();
    }
    two.join();
    four.join();
    EXPECT_EQ(returned.load(), 3);
  }
}

TEST(Countdown, TimedWaitSaysWhetherTheCountWasReached) {
  Countdown done;
  done.finish();
  EXPECT_FALSE(done.wait_for(2, std::chrono::milliseconds(5)));
  std::thread last([&] { done.finish(); });
  EXPECT_TRUE(done.wait_for(2, std::chrono::seconds(60)));
  last.join();
  EXPECT_TRUE(done.wait_for(1, std::chrono::milliseconds(0)));
}

}  // namespace
}  // namespace roundpipe
