#include "schedule/scheduler.h"

#include <c10/util/Exception.h>

namespace roundpipe {

const char* job_kind_name(JobKind kind) {
  switch (kind) {
    case JobKind::kForward: return "forward";
    case JobKind::kFused: return "fused";
    case JobKind::kBackward: return "backward";
  }
  return "?";
}

namespace {

void add_jobs(std::vector<JobSpec>& jobs, const std::vector<LayerRange>& ranges, JobKind kind,
              JobKind first_kind) {
  for (size_t s = 0; s < ranges.size(); ++s) {
    jobs.push_back(JobSpec{s == 0 ? first_kind : kind, ranges[s], static_cast<int64_t>(s), 0});
  }
}

}  // namespace

std::vector<JobSpec> make_jobs(const ModelExecutePlan& plan, CallKind kind) {
  std::vector<JobSpec> jobs;
  switch (kind) {
    case CallKind::kForward:
      add_jobs(jobs, plan.fwd_plan, JobKind::kForward, JobKind::kForward);
      break;
    case CallKind::kBackward:
      add_jobs(jobs, plan.bwd_plan, JobKind::kBackward, JobKind::kBackward);
      break;
    case CallKind::kFused:
      add_jobs(jobs, plan.fwd_plan, JobKind::kForward, JobKind::kForward);
      add_jobs(jobs, plan.bwd_plan, JobKind::kBackward, JobKind::kFused);
      break;
  }
  return jobs;
}

RoundRobin::RoundRobin(int64_t pool_size) : pool_size_(pool_size) {
  TORCH_CHECK_VALUE(pool_size >= 1, "RoundRobin needs a pool of at least 1 device, got ", pool_size);
}

void RoundRobin::assign(std::vector<JobSpec>& jobs, int64_t num_devices) {
  TORCH_CHECK_VALUE(num_devices >= 1 && num_devices <= pool_size_, "asked for ", num_devices,
                    " devices; the pool has ", pool_size_, " (ROUNDPIPE_DEVICES)");
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t n = static_cast<int64_t>(jobs.size());
  for (int64_t i = 0; i < n; ++i) jobs[i].device = (next_ + i) % num_devices;
  next_ += n;  // not reduced: every device count sees its own rotation (2^63 jobs do not come)
}

}  // namespace roundpipe
