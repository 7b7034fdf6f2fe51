#include "schedule/scheduler.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

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

Dispatcher::Dispatcher(int64_t pool_size) : pool_size_(pool_size) {
  TORCH_CHECK_VALUE(pool_size >= 1, "Dispatcher needs a pool of at least 1 device, got ", pool_size);
  free_ms_.assign(pool_size, 0.0);
}

void Dispatcher::assign(std::vector<JobSpec>& jobs, int64_t num_devices,
                        const std::vector<double>& job_ms, int64_t num_microbatch, CallIssue issue) {
  TORCH_CHECK_VALUE(num_devices >= 1 && num_devices <= pool_size_, "asked for ", num_devices,
                    " devices; the pool has ", pool_size_, " (ROUNDPIPE_DEVICES)");
  TORCH_CHECK_VALUE(job_ms.empty() || job_ms.size() == jobs.size(), "Dispatcher: ", job_ms.size(),
                    " job times for ", jobs.size(), " jobs; give one per job or none");
  for (double t : job_ms) {
    TORCH_CHECK_VALUE(std::isfinite(t) && t >= 0, "Dispatcher: a job time of ", t,
                      " ms; times must be finite and >= 0");
  }
  TORCH_CHECK_VALUE(num_microbatch >= 1, "Dispatcher: num_microbatch must be >= 1, got ",
                    num_microbatch);
  std::lock_guard<std::mutex> lock(mu_);
  if (std::all_of(job_ms.begin(), job_ms.end(), [](double t) { return t == 0; })) {
    // Nothing known: round-robin. (Through the ledger, jobs of time 0 would
    // all tie on the device that became free last.)
    for (JobSpec& job : jobs) {
      job.device = next_ % num_devices;
      next_ = job.device + 1;
    }
    return;
  }
  const double ready = issue == CallIssue::kAtOnce     ? issued_ms_
                       : issue == CallIssue::kAtLosses ? losses_ms_
                                                       : end_ms_;
  issued_ms_ = ready;
  // [m]: when the previous job's microbatch m ends (the call's inputs: ready).
  std::vector<double> before(num_microbatch, ready);
  double losses = -1, end = ready;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const double t = job_ms[i];
    int64_t best = -1;
    double best_start = 0;
    for (int64_t k = 0; k < num_devices; ++k) {
      const int64_t d = (next_ + k) % num_devices;
      const double start = std::max(free_ms_[d], before[0]);
      const bool better =
          best < 0 || start < best_start || (start == best_start && free_ms_[d] > free_ms_[best]);
      if (better) {
        best = d;
        best_start = start;
      }
    }
    double at = best_start;
    for (int64_t m = 0; m < num_microbatch; ++m) before[m] = at = std::max(at, before[m]) + t;
    free_ms_[best] = at;
    end = std::max(end, at);
    if (jobs[i].kind == JobKind::kFused) losses = at;
    jobs[i].device = best;
    next_ = best + 1;
  }
  losses_ms_ = losses < 0 ? end : losses;
  end_ms_ = end;
}

std::vector<double> job_times_ms(const std::vector<JobSpec>& jobs, const LayerCosts& costs) {
  std::vector<double> out;
  for (const JobSpec& job : jobs) {
    TORCH_CHECK_VALUE(job.layers.begin >= 0 && job.layers.end <= costs.num_layers() &&
                          static_cast<int64_t>(costs.recompute_ms.size()) == costs.num_layers() &&
                          static_cast<int64_t>(costs.bwd_ms.size()) == costs.num_layers(),
                      "job_times_ms: a job covers layers [", job.layers.begin, ", ", job.layers.end,
                      ") but the costs have ", costs.num_layers(), " layers");
    double t = 0;
    for (int64_t l = job.layers.begin; l < job.layers.end; ++l) {
      switch (job.kind) {
        case JobKind::kForward: t += costs.fwd_ms[l]; break;
        case JobKind::kFused: t += costs.fwd_ms[l] + costs.bwd_ms[l]; break;
        case JobKind::kBackward: t += costs.recompute_ms[l] + costs.bwd_ms[l]; break;
      }
    }
    out.push_back(t);
  }
  return out;
}

}  // namespace roundpipe
