// The lane programs a call's jobs execute (schedule/lane_program.h).
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "schedule/lane_program.h"

namespace roundpipe {
namespace {

// A fused call over `plan`'s stages, devices assigned round-robin from 0.
std::vector<JobSpec> fused_jobs(const ModelExecutePlan& plan, int64_t devices) {
  std::vector<JobSpec> jobs = make_jobs(plan, CallKind::kFused);
  Dispatcher(devices).assign(jobs, devices);
  return jobs;
}

ModelExecutePlan two_by_two() {
  ModelExecutePlan plan;
  plan.fwd_plan = {{0, 2}, {2, 4}};
  plan.bwd_plan = {{4, 6}, {2, 4}, {0, 2}};
  return plan;
}

std::string describe(const JobProgram& p) {
  std::string out;
  for (const LaneOp& op : p.ops) {
    out += std::string(op_kind_name(op.kind)) + "(" + std::to_string(op.job) +
           (op.microbatch >= 0 ? "," + std::to_string(op.microbatch) : "") + ") ";
  }
  return out;
}

TEST(LaneProgram, OneDeviceUploadsTheFirstStageAndPrefetchesEachNextAfterTheFirstMicrobatch) {
  const std::vector<JobSpec> jobs = fused_jobs(two_by_two(), 1);
  const std::vector<JobProgram> p = make_lane_programs(jobs, 2);
  ASSERT_EQ(p.size(), 5u);
  EXPECT_EQ(describe(p[0]),
            "take slot(0) upload stage(0) upload input(0,0) compute(0,0) hand off(0,0) take slot(1) "
            "upload stage(1) upload input(0,1) compute(0,1) hand off(0,1) download buffers(0) give back slot(0) ");
  EXPECT_EQ(describe(p[2]),
            "upload input(2,0) compute(2,0) hand off(2,0) take slot(3) upload stage(3) upload input(2,1) "
            "compute(2,1) hand off(2,1) download grads(2) download buffers(2) give back slot(2) ");
  EXPECT_EQ(describe(p[4]),
            "upload input(4,0) compute(4,0) hand off(4,0) upload input(4,1) compute(4,1) hand off(4,1) "
            "download grads(4) give back slot(4) ");
  // Job 2's first compute waits for its input and for the stage job 1 prefetched.
  EXPECT_EQ(stage_upload(p, 2), (OpRef{1, 4}));
  const LaneOp& first = p[2].ops[1];
  ASSERT_EQ(first.kind, OpKind::kCompute);
  EXPECT_EQ(first.after, (std::vector<OpRef>{OpRef{2, 0}, OpRef{1, 4}}));
  EXPECT_EQ(p[2].ops[4].after, (std::vector<OpRef>{OpRef{2, 3}}));  // the prefetch waits for its slot only
  // Job 2's input m is job 1's hand-off of m.
  EXPECT_EQ(p[2].ops[0].after, (std::vector<OpRef>{OpRef{1, 2}}));
  EXPECT_EQ(p[2].ops[5].after, (std::vector<OpRef>{OpRef{1, 7}}));
}

TEST(LaneProgram, EveryStageIsUploadedOnceOnItsDeviceAfterTakingASlotAndEveryJobGivesOneBack) {
  for (int64_t devices : {1, 2, 3, 5}) {
    for (int64_t m : {1, 3}) {
      const std::vector<JobSpec> jobs = fused_jobs(two_by_two(), devices);
      const std::vector<JobProgram> p = make_lane_programs(jobs, m);
      std::map<int64_t, int> uploads, computes, give_backs;
      for (size_t j = 0; j < p.size(); ++j) {
        const std::vector<LaneOp>& ops = p[j].ops;
        for (size_t i = 0; i < ops.size(); ++i) {
          const LaneOp& op = ops[i];
          if (op.kind == OpKind::kUploadStage) {
            ++uploads[op.job];
            EXPECT_EQ(jobs[op.job].device, jobs[j].device) << "a stage uploaded to another device";
            ASSERT_EQ(op.after.size(), 1u);
            EXPECT_EQ(ops[op.after[0].index].kind, OpKind::kTakeSlot);
            EXPECT_EQ(ops[op.after[0].index].job, op.job);
          }
          if (op.kind == OpKind::kCompute) ++computes[static_cast<int64_t>(j)];
          if (op.kind == OpKind::kGiveBackSlot) {
            ++give_backs[static_cast<int64_t>(j)];
            EXPECT_EQ(i + 1, ops.size()) << "the give-back is the job's last operation";
            EXPECT_EQ(op.after.size(), ops.size() - 1);
          }
          for (const OpRef& ref : op.after) {
            EXPECT_LE(ref.job, static_cast<int64_t>(j)) << "an operation waits for a later job";
            if (ref.job == static_cast<int64_t>(j)) {
              EXPECT_LT(ref.index, static_cast<int64_t>(i));
            }
          }
        }
      }
      for (size_t j = 0; j < jobs.size(); ++j) {
        EXPECT_EQ(uploads[j], 1) << "job " << j << ", " << devices << " devices";
        EXPECT_EQ(computes[j], m);
        EXPECT_EQ(give_backs[j], 1);
        // Its first compute waits for its stage's upload.
        const OpRef up = stage_upload(p, static_cast<int64_t>(j));
        bool waits = false;
        for (const LaneOp& op : p[j].ops) {
          if (op.kind == OpKind::kCompute && op.microbatch == 0) {
            for (const OpRef& ref : op.after) waits = waits || ref == up;
          }
        }
        EXPECT_TRUE(waits) << "job " << j;
      }
    }
  }
}

TEST(LaneProgram, ForwardAndBackwardJobsDownloadWhatTheyUpdate) {
  ModelExecutePlan plan = two_by_two();
  std::vector<JobSpec> fwd = make_jobs(plan, CallKind::kForward);
  std::vector<JobSpec> bwd = make_jobs(plan, CallKind::kBackward);
  Dispatcher(2).assign(fwd, 2);
  Dispatcher(2).assign(bwd, 2);
  auto kinds = [](const JobProgram& p) {
    std::map<OpKind, int> n;
    for (const LaneOp& op : p.ops) ++n[op.kind];
    return n;
  };
  for (const JobProgram& p : make_lane_programs(fwd, 2)) {
    EXPECT_EQ(kinds(p)[OpKind::kDownloadGrads], 0);
    EXPECT_EQ(kinds(p)[OpKind::kDownloadBuffers], 1);
  }
  for (const JobProgram& p : make_lane_programs(bwd, 2)) {
    EXPECT_EQ(kinds(p)[OpKind::kDownloadGrads], 1);
    EXPECT_EQ(kinds(p)[OpKind::kDownloadBuffers], 0);
  }
  EXPECT_THROW(make_lane_programs(fwd, 0), c10::ValueError);
}

}  // namespace
}  // namespace roundpipe
