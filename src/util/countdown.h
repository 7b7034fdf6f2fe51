// Counts finished tasks for their waiters (a call waiting for its jobs).
//
// finish() wakes the waiters only when the count reaches the smallest count
// one of them waits for: a call's jobs finish one by one on the devices'
// workers, and waking the caller at each of them would cost a context switch
// per job.
//
// The last finish() may be the last use of the object before the waiter
// frees it: finish() notifies while holding the lock, so the waiter cannot
// see the count, return and free the object while notify_all is still using
// the condition variable.
//
// Thread-safety: thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <mutex>

namespace roundpipe {

class Countdown {
 public:
  // One more task finished.
  void finish() {
    std::lock_guard<std::mutex> lock(mu_);
    if (++finished_ < wake_at_) return;
    wake_at_ = kNobody;  // the woken waiters that still wait set it again
    cv_.notify_all();
  }
  // Blocks until `n` tasks have finished.
  void wait_for(int64_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    while (finished_ < n) {
      if (n < wake_at_) wake_at_ = n;
      cv_.wait(lock);
    }
  }
  // The same for at most `timeout`; true when `n` tasks have finished.
  template <typename Duration>
  bool wait_for(int64_t n, Duration timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::unique_lock<std::mutex> lock(mu_);
    while (finished_ < n) {
      if (n < wake_at_) wake_at_ = n;
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) return finished_ >= n;
    }
    return true;
  }

 private:
  static constexpr int64_t kNobody = std::numeric_limits<int64_t>::max();
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t finished_ = 0;       // guarded by mu_
  int64_t wake_at_ = kNobody;  // guarded by mu_: the smallest count a waiter waits for
};

}  // namespace roundpipe
