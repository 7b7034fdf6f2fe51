// Counts finished tasks for one waiter (a call waiting for its jobs).
//
// The last finish() may be the last use of the object before the waiter
// frees it: finish() notifies while holding the lock, so the waiter cannot
// see the count, return and free the object while notify_all is still using
// the condition variable.
//
// Thread-safety: thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace roundpipe {

class Countdown {
 public:
  // One more task finished.
  void finish() {
    std::lock_guard<std::mutex> lock(mu_);
    ++finished_;
    cv_.notify_all();
  }
  // Blocks until `n` tasks have finished.
  void wait_for(int64_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return finished_ >= n; });
  }
  // The same for at most `timeout`; true when `n` tasks have finished.
  template <typename Duration>
  bool wait_for(int64_t n, Duration timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return finished_ >= n; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t finished_ = 0;  // guarded by mu_
};

}  // namespace roundpipe
