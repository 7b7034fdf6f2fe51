#include "engine/lifetime.h"

#include <atomic>
#include <cstdlib>
#include <future>
#include <mutex>

#include "util/worker_thread.h"

namespace roundpipe {
namespace {

std::atomic<bool (*)()> wait_forbidden{nullptr};

std::mutex reaper_mu;
WorkerThread* reaper = nullptr;  // guarded by reaper_mu; created on first use, never destroyed

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
  the_reaper().post(std::move(destroy));
}

void set_wait_forbidden_check(bool (*check)()) { wait_forbidden.store(check); }

void wait_for_pending_destructions() {
  WorkerThread* r = nullptr;
  {
    std::lock_guard<std::mutex> lock(reaper_mu);
    r = reaper;
  }
  if (r == nullptr || r->on_this_thread()) return;
  std::promise<void> done;
  r->post([&done] { done.set_value(); });
  done.get_future().wait();
}

}  // namespace roundpipe
