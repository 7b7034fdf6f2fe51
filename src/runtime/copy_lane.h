// An asynchronous copy lane of a CPU virtual device: a thread that runs the
// copies issued to it in issue order, each no earlier than a fixed delay after
// it was issued (ROUNDPIPE_CPU_COPY_DELAY_US), as a GPU's copy engine does.
//
// The issuing thread moves on at once; it learns that a copy is done only
// through a fence. A copy holds its source and destination until it has run,
// so memory charged to the device is released no earlier than the fence of
// its last use completes.
//
// Without a delay, a copy issued to an idle lane whose prerequisite has
// completed runs at once on the issuing thread (what a GPU's idle copy engine
// would do at once), so prompt copies cost no thread hand-off.
//
// Thread-safety: thread-safe. The destructor runs what was issued, then joins.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "runtime/device.h"

namespace roundpipe {

class CopyLane {
 public:
  CopyLane(std::string name, std::chrono::microseconds delay);
  ~CopyLane();
  CopyLane(const CopyLane&) = delete;
  CopyLane& operator=(const CopyLane&) = delete;

  // Queues `copy`, run after everything issued before it, no earlier than the
  // lane's delay from now. An error it throws fails the lane's later fences.
  void issue(std::function<void()> copy);
  // Queues `copy` to run once `after` has completed (on the lane's thread).
  void issue_after(FencePtr after, std::function<void()> copy);
  // Completes when everything issued so far has run.
  FencePtr fence();
  // A time mark taken when the lane reaches this point.
  MarkPtr mark();
  // Blocks until everything issued so far has run.
  void synchronize() { fence()->synchronize(); }

  std::chrono::microseconds delay() const { return std::chrono::microseconds(delay_us_.load()); }
  // Applies to copies issued from now on.
  void set_delay(std::chrono::microseconds delay) { delay_us_.store(delay.count()); }

 private:
  struct Item {
    std::chrono::steady_clock::time_point due;
    std::function<void()> run;
  };
  struct State {
    std::mutex mu;
    // Two conditions, so that a copy run inline does not wake the idle lane
    // thread: `work` for the lane's thread (an item queued, the lane free
    // again with items queued, stopping), `done` for fences and marks.
    std::condition_variable work;
    std::condition_variable done;
    std::deque<Item> queue;
    int64_t issued = 0;
    int64_t completed = 0;
    std::exception_ptr error;  // the first copy that failed
    std::string name;
    bool stopping = false;
    bool running = false;  // an item is running (on the lane's thread or inline)
  };
  class LaneFence;
  class LaneMark;

  void enqueue(std::chrono::steady_clock::time_point due, std::function<void()> run);
  // Without a delay, a copy issued to an idle lane whose `after` has
  // completed runs at once on the issuing thread: same order, same fences,
  // no hand-off to the lane's thread.
  bool run_now_if_idle(const FencePtr& after, const std::function<void()>& copy);
  void finish(std::exception_ptr error);  // one item done
  void loop();

  std::atomic<int64_t> delay_us_;
  std::shared_ptr<State> state_;  // shared with the fences, which may outlive the lane
  std::thread thread_;
};

}  // namespace roundpipe
