// Per-layer readiness of the model's parameters while the optimizer thread
// writes them (the optimizer -> model copy of a step).
//
// A step begins a write of every layer (a generation); the optimizer thread
// writes the layers in order and marks each one. A call records the
// generation issued before it, and its jobs wait, layer by layer, only for
// the layers they upload: the first stages of the next iteration start while
// later layers are still being written, and no upload reads a half-written
// parameter.
//
// Thread-safety: thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "util/interrupt.h"

namespace roundpipe {

class ParamGate {
 public:
  explicit ParamGate(int64_t num_layers) : written_(static_cast<size_t>(num_layers), 0) {}

  // A write of every layer begins; returns its generation (1, 2, ...).
  int64_t begin_write() {
    std::lock_guard<std::mutex> lock(mu_);
    return ++issued_;
  }
  // Generation of the latest write begun (what a new call must wait for).
  int64_t issued() const {
    std::lock_guard<std::mutex> lock(mu_);
    return issued_;
  }
  // Layer `layer` holds the values of write `generation`.
  void mark_written(int64_t layer, int64_t generation) {
    std::lock_guard<std::mutex> lock(mu_);  // notified under the lock: a waiter may free the gate next
    int64_t& w = written_.at(static_cast<size_t>(layer));
    if (generation > w) w = generation;
    cv_.notify_all();
  }
  // Every layer holds the values of write `generation` (also after a failed write).
  void mark_all_written(int64_t generation) {
    for (size_t l = 0; l < written_.size(); ++l) mark_written(static_cast<int64_t>(l), generation);
  }
  // Waits until `layer` holds the values of write `generation` or a later one.
  // Interruptible on a thread with an InterruptScope (the write goes on).
  void wait(int64_t layer, int64_t generation) const {
    std::unique_lock<std::mutex> lock(mu_);
    const auto done = [&] { return written_.at(static_cast<size_t>(layer)) >= generation; };
    if (!interruptible()) {
      cv_.wait(lock, done);
      return;
    }
    while (!cv_.wait_for(lock, kInterruptPollPeriod, done)) {
      lock.unlock();  // the poll may take the GIL: never under this lock
      if (std::exception_ptr e = poll_interrupt()) std::rethrow_exception(e);
      lock.lock();
    }
  }
  // True when `layer` holds write `generation` or a later one (never blocks).
  bool written(int64_t layer, int64_t generation) const {
    std::lock_guard<std::mutex> lock(mu_);
    return written_.at(static_cast<size_t>(layer)) >= generation;
  }
  void wait_all(int64_t generation) const {
    for (size_t l = 0; l < written_.size(); ++l) wait(static_cast<int64_t>(l), generation);
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  int64_t issued_ = 0;            // guarded by mu_
  std::vector<int64_t> written_;  // guarded by mu_: per layer, the latest generation written
};

}  // namespace roundpipe
