// Long waits that the waiting thread's caller can interrupt (Python's Ctrl-C).
//
// A language binding installs an InterruptScope around a blocking call; the
// engine's long waits on that thread then poll it about every 50 ms. A poll
// returns the exception to raise (e.g. the KeyboardInterrupt Python's signal
// handler made) or nullptr to keep waiting. Without a scope, waits are plain.
//
// What an interrupted wait does is the waiter's choice: a call cancels its
// jobs and fails as on any error (nothing half-applied); a wait for queued
// optimizer work just stops waiting (the work finishes on its own).
//
// Thread-safety: the scope and the poll are per thread.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <future>

namespace roundpipe {

using InterruptPoll = std::function<std::exception_ptr()>;

constexpr std::chrono::milliseconds kInterruptPollPeriod{50};

class InterruptScope {
 public:
  explicit InterruptScope(InterruptPoll poll);
  ~InterruptScope();
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;

 private:
  InterruptPoll previous_;
};

// This thread's poll result: nullptr without a scope or when not interrupted.
std::exception_ptr poll_interrupt();

// True when this thread has an InterruptScope (waits should poll).
bool interruptible();

// Waits for `future`, rethrowing an interrupt of this thread's scope.
template <typename T>
void wait_interruptibly(const std::future<T>& future) {
  if (!interruptible()) {
    future.wait();
    return;
  }
  while (future.wait_for(kInterruptPollPeriod) != std::future_status::ready) {
    if (std::exception_ptr e = poll_interrupt()) std::rethrow_exception(e);
  }
}

}  // namespace roundpipe
