// WorkerThread: FIFO order, posting from many threads, the destructor runs
// what was posted. (Also built with ThreadSanitizer by scripts/tsan --primitives.)
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "util/worker_thread.h"

namespace roundpipe {
namespace {

TEST(WorkerThread, RunsInitFirstThenTasksInPostingOrder) {
  std::vector<int> seen;  // written only by the worker; read after it joined
  {
    WorkerThread worker([&] { seen.push_back(-1); });
    for (int i = 0; i < 100; ++i) worker.post([&seen, i] { seen.push_back(i); });
  }
  ASSERT_EQ(seen.size(), 101u);
  for (int i = 0; i <= 100; ++i) EXPECT_EQ(seen[i], i - 1);
}

TEST(WorkerThread, TasksFromManyThreadsAllRunOnTheWorker) {
  std::atomic<int> ran{0}, elsewhere{0};
  {
    WorkerThread worker;
    std::vector<std::thread> posters;
    for (int t = 0; t < 4; ++t) {
      posters.emplace_back([&] {
        for (int i = 0; i < 250; ++i) {
          worker.post([&] {
            if (!worker.on_this_thread()) ++elsewhere;
            ++ran;
          });
        }
      });
    }
    for (auto& p : posters) p.join();
    EXPECT_FALSE(worker.on_this_thread());
  }
  EXPECT_EQ(ran.load(), 1000);
  EXPECT_EQ(elsewhere.load(), 0);
}

TEST(WorkerThread, ATaskMayPostMoreWorkThatRunsBeforeTheDestructorReturns) {
  std::atomic<int> ran{0};
  {
    WorkerThread worker;
    worker.post([&] {
      ++ran;
      worker.post([&] { ++ran; });
    });
  }
  EXPECT_EQ(ran.load(), 2);
}

}  // namespace
}  // namespace roundpipe
