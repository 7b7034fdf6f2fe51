// The searched plan of fused calls whose iterations overlap
// (search_overlapped_plan, plan_search.h), computed on a background thread
// at a lower priority than the engine's, so that no call waits for a search:
// calls go on with the plan they have until the search is done, and the
// planner adopts its result between calls.
//
// Thread-safety: one owner thread (the model's user thread) calls
// everything; the search runs on a thread of its own, which only reads
// what it was given and writes its result under the mutex.
#pragma once

#include <roundpipe/auto_plan.h>
#include <roundpipe/plan.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include <c10/util/Optional.h>

namespace roundpipe {

class PlanSearcher {
 public:
  PlanSearcher() = default;
  PlanSearcher(const PlanSearcher&) = delete;
  PlanSearcher& operator=(const PlanSearcher&) = delete;
  // Stops a search in progress (at its next simulation) and joins it.
  ~PlanSearcher();

  // The plan searched from `from` for `num_devices` devices and
  // `num_microbatch` microbatches over `costs`, once the search is done;
  // until then null, and a search for them runs (one started now, over
  // these costs, replacing one for other arguments).
  c10::optional<ModelExecutePlan> find(const LayerCosts& costs, const ModelExecutePlan& from, int64_t num_devices,
                                       int64_t num_microbatch);
  // Blocks until no search runs.
  void wait() const;

 private:
  void stop_and_join();

  std::thread thread_;
  std::atomic<bool> stop_{false};
  ModelExecutePlan from_;  // owner thread: what the current or last search started from
  int64_t num_microbatch_ = 0;
  bool started_ = false;   // owner thread: a search for (from_, num_microbatch_) was started
  mutable std::mutex mu_;
  mutable std::condition_variable done_cv_;
  bool running_ = false;                 // guarded by mu_
  c10::optional<ModelExecutePlan> plan_;  // guarded by mu_: the finished search's plan
};

}  // namespace roundpipe
