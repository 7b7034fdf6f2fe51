// The scheduler's device assignment: round-robin without times, predicted
// start with them.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <vector>

#include "schedule/scheduler.h"

using namespace roundpipe;

namespace {

std::vector<JobSpec> Jobs(int64_t n) {
  std::vector<JobSpec> jobs;
  for (int64_t i = 0; i < n; ++i) jobs.push_back(JobSpec{JobKind::kForward, {i, i + 1}, i, -1});
  return jobs;
}

std::vector<int64_t> Devices(const std::vector<JobSpec>& jobs) {
  std::vector<int64_t> out;
  for (const JobSpec& j : jobs) out.push_back(j.device);
  return out;
}

}  // namespace

TEST(Dispatcher, WithoutTimesIsRoundRobinContinuedFromCallToCall) {
  Dispatcher d(3);
  std::vector<JobSpec> a = Jobs(4), b = Jobs(4);
  d.assign(a, 3);
  d.assign(b, 3);
  EXPECT_EQ(Devices(a), (std::vector<int64_t>{0, 1, 2, 0}));
  EXPECT_EQ(Devices(b), (std::vector<int64_t>{1, 2, 0, 1}));
  std::vector<JobSpec> c = Jobs(3);
  d.assign(c, 2);  // fewer devices than the pool: the rotation continues within them
  EXPECT_EQ(Devices(c), (std::vector<int64_t>{0, 1, 0}));
}

TEST(Dispatcher, AJobGoesWhereItIsPredictedToStartFirst) {
  // Two devices, 2 microbatches. Job 0 (10 ms each) occupies device 0 until
  // 20; job 1 (1 ms) is ready at 10 and takes idle device 1 until 21; job 2
  // (1 ms) is ready at 11: device 0 frees at 20, device 1 at 21, so device
  // 0, although round-robin would give it device 0 as well; job 3 is ready
  // at 21 with device 0 free at 22 and device 1 at 21: device 1 (round-robin
  // would give device 1 too), then the next call starts at once on the
  // device that frees first.
  Dispatcher d(2);
  std::vector<JobSpec> a = Jobs(4);
  d.assign(a, 2, {10, 1, 1, 1}, 2, CallIssue::kAtOnce);
  EXPECT_EQ(Devices(a), (std::vector<int64_t>{0, 1, 0, 1}));
  EXPECT_DOUBLE_EQ(d.predicted_end_ms(), 23);
  // One microbatch: each job is ready when the one before it ends, so a
  // device that frees just then ties with idle ones and keeps the chain (no
  // hand-off); the next call, issued at once, avoids the busy device.
  Dispatcher e(3);
  std::vector<JobSpec> b = Jobs(3), c = Jobs(3);
  e.assign(b, 3, {100, 1, 1}, 1, CallIssue::kAtOnce);
  e.assign(c, 3, {1, 1, 1}, 1, CallIssue::kAtOnce);
  EXPECT_EQ(Devices(b), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(Devices(c), (std::vector<int64_t>{1, 1, 1}));
  EXPECT_DOUBLE_EQ(e.predicted_end_ms(), 3);
}

TEST(Dispatcher, JobTimesAreTheStageTimesOfThePlanner) {
  LayerCosts costs;
  costs.fwd_ms = {1, 2};
  costs.recompute_ms = {3, 4};
  costs.bwd_ms = {5, 6};
  costs.param_bytes = {0, 0};
  std::vector<JobSpec> jobs{{JobKind::kForward, {0, 2}, 0, 0},
                            {JobKind::kFused, {1, 2}, 0, 0},
                            {JobKind::kBackward, {0, 1}, 1, 0}};
  EXPECT_EQ(job_times_ms(jobs, costs), (std::vector<double>{3, 8, 8}));
}

TEST(Dispatcher, BadArgumentsAreValueErrors) {
  Dispatcher d(2);
  std::vector<JobSpec> jobs = Jobs(2);
  EXPECT_THROW(d.assign(jobs, 3), c10::ValueError);
  EXPECT_THROW(d.assign(jobs, 0), c10::ValueError);
  EXPECT_THROW(d.assign(jobs, 2, {1}, 1, CallIssue::kAtOnce), c10::ValueError);
  EXPECT_THROW(d.assign(jobs, 2, {1, -1}, 1, CallIssue::kAtOnce), c10::ValueError);
  EXPECT_THROW(d.assign(jobs, 2, {1, 1}, 0, CallIssue::kAtOnce), c10::ValueError);
  EXPECT_THROW(Dispatcher(0), c10::ValueError);
  EXPECT_EQ(jobs[0].device, -1);  // a rejected call assigns nothing
}
