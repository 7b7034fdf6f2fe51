// The scheduler: turns one call (a plan and what the call does) into jobs, one
// per stage, and gives each job a device, round-robin over the pool. A job
// runs all microbatches of its stage, in microbatch order; job j's input for
// microbatch m is job j-1's output for microbatch m. A device runs the jobs
// it is given in the order they were assigned (FIFO).
//
// Everything here is deterministic given its inputs, so the engine and the
// simulator (simulator.h) drive the same code.
//
// Thread-safety: make_jobs is a pure function; RoundRobin is thread-safe.
#pragma once

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
  int64_t device = 0;  // pool index (set by RoundRobin::assign)
};

// The jobs of one call in pipeline order, devices not yet assigned. The plan
// must be valid for the call (ModelExecutePlan::validate).
std::vector<JobSpec> make_jobs(const ModelExecutePlan& plan, CallKind kind);

// Round-robin device assignment that continues from call to call, so that
// consecutive calls (and models sharing the pool) spread over all devices.
class RoundRobin {
 public:
  // `pool_size` >= 1 devices.
  explicit RoundRobin(int64_t pool_size);

  // Gives jobs[i].device = (next + i) % num_devices for each job, then moves
  // `next` on by the number of jobs, so that a model's next call starts on
  // the device after its last job's, also on fewer devices than the pool
  // (the next call's first job then queues behind the fewest of this one's).
  // 1 <= num_devices <= pool size, else c10::ValueError.
  void assign(std::vector<JobSpec>& jobs, int64_t num_devices);

  int64_t pool_size() const { return pool_size_; }

 private:
  const int64_t pool_size_;
  std::mutex mu_;
  int64_t next_ = 0;  // guarded by mu_: jobs assigned so far
};

}  // namespace roundpipe
