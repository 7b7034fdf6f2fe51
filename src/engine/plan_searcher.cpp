#include "engine/plan_searcher.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <exception>

#include <c10/util/Exception.h>

#include "schedule/plan_search.h"

namespace roundpipe {

namespace {

// Below the engine's threads: a search shares the host's cores with the
// device workers and the optimizer, which must not wait for it.
void lower_this_threads_priority() {
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);  // best effort
}

}  // namespace

PlanSearcher::~PlanSearcher() { stop_and_join(); }

void PlanSearcher::stop_and_join() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  thread_.join();
  stop_.store(false);
}

c10::optional<ModelExecutePlan> PlanSearcher::find(const LayerCosts& costs, const ModelExecutePlan& from,
                                                   int64_t num_devices, int64_t num_microbatch) {
  if (started_ && from_ == from && num_microbatch_ == num_microbatch) {
    std::lock_guard<std::mutex> lock(mu_);
    return plan_;  // null while it runs
  }
  stop_and_join();  // a search for other arguments: its result is not wanted
  {
    std::lock_guard<std::mutex> lock(mu_);
    plan_.reset();
    running_ = true;
  }
  from_ = from;
  num_microbatch_ = num_microbatch;
  started_ = true;
  thread_ = std::thread([this, costs, from, num_devices, num_microbatch] {
    lower_this_threads_priority();
    c10::optional<ModelExecutePlan> found;
    try {
      found = search_overlapped_plan(costs, from, num_devices, num_microbatch, &stop_).plan;
    } catch (const std::exception& e) {
      TORCH_WARN("RoundPipe: the plan search failed (", e.what(), "); calls keep the balanced plan");
      found = from;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stop_.load()) plan_ = std::move(found);
      running_ = false;
    }
    done_cv_.notify_all();
  });
  return c10::nullopt;
}

void PlanSearcher::wait() const {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return !running_; });
}

}  // namespace roundpipe
