// A thread that runs closures in FIFO order.
//
// Thread-safety: post() is thread-safe. The thread is owned by the object:
// the destructor runs every task already posted, then joins. The destructor
// must not run on the worker's own thread (it cannot join itself): owners
// that may be released there hand their destruction to another thread
// (engine/lifetime.h).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace roundpipe {

class WorkerThread {
 public:
  // `init` runs first on the new thread (thread-local set-up).
  explicit WorkerThread(std::function<void()> init = nullptr);
  ~WorkerThread();
  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;

  // Queues `task`. Tasks must not throw: they report errors themselves.
  void post(std::function<void()> task);
  // True when called from this worker's thread.
  bool on_this_thread() const { return std::this_thread::get_id() == thread_.get_id(); }
  // True when called from the thread of any WorkerThread.
  static bool on_a_worker_thread();

 private:
  void loop(const std::function<void()>& init);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  std::thread thread_;
};

}  // namespace roundpipe
