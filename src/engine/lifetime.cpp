#include "engine/lifetime.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>

#include "util/worker_thread.h"

namespace roundpipe {
namespace {

std::atomic<bool (*)()> wait_forbidden{nullptr};

std::mutex reaper_mu;
WorkerThread* reaper = nullptr;  // guarded by reaper_mu; created on first use, never destroyed
// Destructions handed to the reaper and not yet finished, guarded by
// reaper_mu. A destruction that hands on another (joining an optimizer
// thread whose task drops a second model) counts it before it finishes
// itself, so the count reaches 0 only when the chain has run out.
int unfinished = 0;
std::condition_variable all_finished;

// Never destroyed: static destructors at exit must not join a thread that
// may still be destroying an engine. Exit waits for it instead.
WorkerThread& the_reaper() {
  std::lock_guard<std::mutex> lock(reaper_mu);
  if (reaper == nullptr) {
    reaper = new WorkerThread();
    // Registered after the device pool and every other engine singleton
    // exist, so it runs before their destructors.
    std::atexit(wait_for_pending_destructions);
  }
  return *reaper;
}

bool may_wait_here() {
  if (WorkerThread::on_a_worker_thread()) return false;
  bool (*check)() = wait_forbidden.load();
  return check == nullptr || !check();
}

}  // namespace

void destroy_where_allowed(std::function<void()> destroy) {
  if (may_wait_here()) {
    destroy();
    return;
  }
  WorkerThread& r = the_reaper();
  {
    std::lock_guard<std::mutex> lock(reaper_mu);
    ++unfinished;
  }
  r.post([destroy = std::move(destroy)] {
    destroy();
    std::lock_guard<std::mutex> lock(reaper_mu);
    if (--unfinished == 0) all_finished.notify_all();
  });
}

void set_wait_forbidden_check(bool (*check)()) { wait_forbidden.store(check); }

int unfinished_destructions() {
  std::lock_guard<std::mutex> lock(reaper_mu);
  return unfinished;
}

void wait_for_pending_destructions() {
  std::unique_lock<std::mutex> lock(reaper_mu);
  if (reaper == nullptr || reaper->on_this_thread()) return;
  all_finished.wait(lock, [] { return unfinished == 0; });
}

}  // namespace roundpipe
