// The scheduler: turns one call (a plan and what the call does) into jobs, one
// per stage, and gives each job a device: the one on which it is predicted
// to start first (Dispatcher). A job
// runs all microbatches of its stage, in microbatch order; job j's input for
// microbatch m is job j-1's output for microbatch m. A device runs the jobs
// it is given in the order they were assigned (FIFO).
//
// Everything here is deterministic given its inputs, so the engine and the
// simulator (simulator.h) drive the same code.
//
// Thread-safety: make_jobs and job_times_ms are pure functions; Dispatcher is
// thread-safe.
#pragma once

#include <roundpipe/auto_plan.h>
#include <roundpipe/plan.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace roundpipe {

enum class JobKind { kForward, kFused, kBackward };

// "forward", "fused", "backward".
const char* job_kind_name(JobKind kind);

// What a call does with the model.
enum class CallKind {
  kForward,   // forward(): the forward stages
  kBackward,  // backward after forward(): the backward stages, deepest first
  kFused,     // forward_backward(): forward stages, the fused stage, backward stages
};

struct JobSpec {
  JobKind kind;
  LayerRange layers;
  int64_t stage = 0;   // index in its plan (fwd_plan or bwd_plan)
  int64_t device = 0;  // pool index (set by Dispatcher::assign)
};

// The jobs of one call in pipeline order, devices not yet assigned. The plan
// must be valid for the call (ModelExecutePlan::validate).
std::vector<JobSpec> make_jobs(const ModelExecutePlan& plan, CallKind kind);

// When a call's first job is ready, on the dispatcher's predicted clock.
enum class CallIssue {
  kAtOnce,    // with the previous call: every call is submitted at once
  kAtLosses,  // at the previous call's losses (forward_backward with iteration overlap)
  kAtEnd,     // at the previous call's end (the caller waits for each call)
};

// Device assignment by predicted start, continued from call to call so that
// consecutive calls (and models sharing the pool) spread over all devices.
//
// The dispatcher keeps a ledger: each device's predicted free time on a
// virtual clock. A job of per-microbatch time t runs its M microbatches in
// order, microbatch m starting once the job's previous microbatch and the
// previous job's microbatch m have ended, so a job's first microbatch waits
// for the previous job's first and a stage shorter than the one feeding it
// is paced by it. Each job, in pipeline order, goes to the device on which
// it starts first. Among devices on which it starts equally early (several
// idle before the job is ready), it takes the one that became free last, so
// that the others stay free for work ready earlier (the next call's first
// jobs); then the next device in rotation. The device then is busy until the
// job's last microbatch is predicted to end.
//
// Without times (or all 0: nothing known) the assignment is round-robin,
// continued from the device after the last job's, and the ledger is left as
// it was. Predictions only choose devices: results never depend on
// them, and a device runs its jobs in the order they were assigned (FIFO).
class Dispatcher {
 public:
  // `pool_size` >= 1 devices.
  explicit Dispatcher(int64_t pool_size);

  // Sets jobs[i].device, a device in [0, num_devices), for each job.
  // job_ms[i] is jobs[i]'s predicted time per microbatch (finite, >= 0; an
  // empty vector means all 0), num_microbatch M >= 1, issue when the call's
  // first job is ready. 1 <= num_devices <= pool size. Else c10::ValueError.
  void assign(std::vector<JobSpec>& jobs, int64_t num_devices, const std::vector<double>& job_ms,
              int64_t num_microbatch, CallIssue issue);
  // Round-robin: no times.
  void assign(std::vector<JobSpec>& jobs, int64_t num_devices) {
    assign(jobs, num_devices, {}, 1, CallIssue::kAtEnd);
  }

  int64_t pool_size() const { return pool_size_; }
  // When the last call assigned is predicted to end, on the ledger's clock.
  double predicted_end_ms() {
    std::lock_guard<std::mutex> lock(mu_);
    return end_ms_;
  }

 private:
  const int64_t pool_size_;
  std::mutex mu_;
  // Guarded by mu_: the ledger.
  std::vector<double> free_ms_;  // [device]
  int64_t next_ = 0;             // the device next in rotation
  // The previous call's issue, losses and end.
  double issued_ms_ = 0, losses_ms_ = 0, end_ms_ = 0;
};

// Predicted per-microbatch time of each job from per-layer costs: a forward
// job the sum of fwd_ms, the fused job fwd_ms + bwd_ms, a backward job
// recompute_ms + bwd_ms (the stage times of auto_plan.h). The costs must
// cover the jobs' layers.
std::vector<double> job_times_ms(const std::vector<JobSpec>& jobs, const LayerCosts& costs);

}  // namespace roundpipe
