#include "schedule/lane_program.h"

#include <c10/util/Exception.h>

namespace roundpipe {

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::kTakeSlot: return "take slot";
    case OpKind::kUploadStage: return "upload stage";
    case OpKind::kUploadInput: return "upload input";
    case OpKind::kCompute: return "compute";
    case OpKind::kHandOff: return "hand off";
    case OpKind::kDownloadGrads: return "download grads";
    case OpKind::kDownloadBuffers: return "download buffers";
    case OpKind::kGiveBackSlot: return "give back slot";
  }
  return "?";
}

OpLane op_lane(OpKind kind) {
  switch (kind) {
    case OpKind::kTakeSlot:
    case OpKind::kGiveBackSlot: return OpLane::kHost;
    case OpKind::kUploadStage: return OpLane::kParamUpload;
    case OpKind::kUploadInput: return OpLane::kActUpload;
    case OpKind::kCompute: return OpLane::kCompute;
    case OpKind::kHandOff:
    case OpKind::kDownloadGrads:
    case OpKind::kDownloadBuffers: return OpLane::kDownload;
  }
  return OpLane::kHost;
}

namespace {

// The first job after `j` of the call on j's device; -1: none.
int64_t next_on_device(const std::vector<JobSpec>& jobs, size_t j) {
  for (size_t k = j + 1; k < jobs.size(); ++k) {
    if (jobs[k].device == jobs[j].device) return static_cast<int64_t>(k);
  }
  return -1;
}

bool first_on_device(const std::vector<JobSpec>& jobs, size_t j) {
  for (size_t i = 0; i < j; ++i) {
    if (jobs[i].device == jobs[j].device) return false;
  }
  return true;
}

}  // namespace

std::vector<JobProgram> make_lane_programs(const std::vector<JobSpec>& jobs, int64_t num_microbatch) {
  TORCH_CHECK_VALUE(num_microbatch >= 1, "a lane program needs num_microbatch >= 1, got ", num_microbatch);
  const int64_t n = static_cast<int64_t>(jobs.size());
  std::vector<JobProgram> programs(jobs.size());
  // [job]: its stage upload and its hand-offs, for the ops of later jobs.
  std::vector<OpRef> upload(jobs.size());
  std::vector<std::vector<OpRef>> handoffs(jobs.size());
  for (int64_t j = 0; j < n; ++j) {
    std::vector<LaneOp>& ops = programs[j].ops;
    auto add = [&](OpKind kind, int64_t job, int64_t m, std::vector<OpRef> after) {
      ops.push_back(LaneOp{kind, job, m, std::move(after)});
      return OpRef{j, static_cast<int64_t>(ops.size()) - 1};
    };
    const JobSpec& job = jobs[j];
    if (first_on_device(jobs, j)) {
      const OpRef slot = add(OpKind::kTakeSlot, j, -1, {});
      upload[j] = add(OpKind::kUploadStage, j, -1, {slot});
    }
    const int64_t prefetch = next_on_device(jobs, j);
    OpRef last_compute;
    for (int64_t m = 0; m < num_microbatch; ++m) {
      std::vector<OpRef> producer;
      if (j > 0) producer.push_back(handoffs[j - 1][m]);
      const OpRef input = add(OpKind::kUploadInput, j, m, producer);
      std::vector<OpRef> needs{input};
      if (m == 0) needs.push_back(upload[j]);
      last_compute = add(OpKind::kCompute, j, m, needs);
      handoffs[j].push_back(add(OpKind::kHandOff, j, m, {last_compute}));
      if (m == 0 && prefetch >= 0) {
        const OpRef slot = add(OpKind::kTakeSlot, prefetch, -1, {});
        upload[prefetch] = add(OpKind::kUploadStage, prefetch, -1, {slot});
      }
    }
    if (job.kind != JobKind::kForward) add(OpKind::kDownloadGrads, j, -1, {last_compute});
    if (job.kind != JobKind::kBackward) add(OpKind::kDownloadBuffers, j, -1, {last_compute});
    std::vector<OpRef> everything;
    for (int64_t i = 0; i < static_cast<int64_t>(ops.size()); ++i) everything.push_back(OpRef{j, i});
    add(OpKind::kGiveBackSlot, j, -1, std::move(everything));
  }
  return programs;
}

OpRef stage_upload(const std::vector<JobProgram>& programs, int64_t job) {
  for (int64_t j = 0; j <= job; ++j) {
    const std::vector<LaneOp>& ops = programs.at(j).ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].kind == OpKind::kUploadStage && ops[i].job == job) return OpRef{j, static_cast<int64_t>(i)};
    }
  }
  TORCH_INTERNAL_ASSERT(false, "lane program: job ", job, "'s stage is never uploaded");
}

}  // namespace roundpipe
