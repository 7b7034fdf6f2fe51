#include "util/worker_thread.h"

#include <cstdio>
#include <exception>
#include <utility>

namespace roundpipe {
namespace {

thread_local bool is_worker_thread = false;

}  // namespace

bool WorkerThread::on_a_worker_thread() { return is_worker_thread; }

WorkerThread::WorkerThread(std::function<void()> init)
    : thread_([this, init = std::move(init)] { loop(init); }) {}

WorkerThread::~WorkerThread() {
  if (on_this_thread()) {
    // A bug in the owner, not a user error: say so before the process ends
    // (std::thread would end it with "Resource deadlock avoided").
    std::fputs("roundpipe: internal error: a worker thread was destroyed on its own thread\n", stderr);
    std::terminate();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void WorkerThread::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void WorkerThread::loop(const std::function<void()>& init) {
  is_worker_thread = true;
  if (init) init();
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, and everything posted has run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace roundpipe
