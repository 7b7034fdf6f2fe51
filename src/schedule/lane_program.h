// A job as a program of lane operations: the one description of what a job
// does, in what order, and what each step waits for. The engine's job runner
// (src/engine/job_runner.cpp) executes it on a device, whose lanes are CUDA
// streams or CPU copy threads; the simulator (simulator.h) executes it on a
// virtual clock. Nothing else decides the order of a job's work.
//
// A device has a host side (its worker thread, which issues the operations
// in program order and blocks only in kTakeSlot) and four lanes, each
// running its operations in the order they were issued: parameter upload,
// activation upload, compute and download. An operation waits for the
// operations named in `after` (through their fences) and, implicitly, for
// the one issued before it on its lane.
//
// Thread-safety: make_lane_programs is a pure function; programs are values.
#pragma once

#include <cstdint>
#include <vector>

#include "schedule/scheduler.h"

namespace roundpipe {

// How many jobs' stages a device holds at once: the running stage and the
// prefetched next one.
constexpr int kStageSlots = 2;

enum class OpLane { kHost, kParamUpload, kActUpload, kCompute, kDownload };

enum class OpKind {
  // Host: waits until the device has a free stage slot, i.e. until the
  // fences of the job that last gave one back completed (at most
  // kStageSlots slots taken or not yet completed).
  kTakeSlot,
  // Parameter upload: the parameters and buffers of job `job`'s stage, in
  // one batch, once the optimizer wrote them (the parameter gate).
  kUploadStage,
  // Activation upload: microbatch m's inputs (the previous job's hand-off,
  // a backward stage's saved input, the fused stage's label), unless they
  // are on this device already.
  kUploadInput,
  // Compute: microbatch m through the stage (a forward job also hands the
  // inputs saved for backward stages to the host as it reaches them).
  kCompute,
  // Download: microbatch m's result to the next job's device (it stays when
  // that is this device) or to the host.
  kHandOff,
  // Download: the stage's gradients, summed over tied uses, in one batch.
  kDownloadGrads,
  // Download: the buffers this stage's forward updated.
  kDownloadBuffers,
  // Host: gives the job's slot back with the fences of all four lanes.
  kGiveBackSlot,
};

// "take slot", "upload stage", "upload input", "compute", "hand off",
// "download grads", "download buffers", "give back slot".
const char* op_kind_name(OpKind kind);
OpLane op_lane(OpKind kind);

// An operation of a call: op `index` of job `job`'s program.
struct OpRef {
  int64_t job = -1;
  int64_t index = -1;
  bool operator==(const OpRef& o) const { return job == o.job && index == o.index; }
};

struct LaneOp {
  OpKind kind;
  int64_t job;             // whose stage or microbatch (a prefetch uploads a later job's stage)
  int64_t microbatch;      // -1: the whole stage
  std::vector<OpRef> after;  // waits for these (beyond its lane's order)
};

struct JobProgram {
  std::vector<LaneOp> ops;
};

// The programs of a call's jobs, whose devices are assigned. For job j on
// device d:
//   - unless an earlier job of the call runs on d: take slot, upload stage;
//   - for each microbatch m: upload input m (after the previous job's hand
//     off of m), compute m (after upload input m; the first also after its
//     stage's upload), hand off m (after compute m); after hand off 0, when a
//     later job of the call runs on d: take slot and upload stage for the
//     first such job (the prefetch, which the first compute never waits for);
//   - download grads (fused and backward jobs) and download buffers (forward
//     and fused jobs), after the last compute;
//   - give back slot, after everything.
std::vector<JobProgram> make_lane_programs(const std::vector<JobSpec>& jobs, int64_t num_microbatch);

// Where job `job`'s stage is uploaded: the kUploadStage op of its own or of
// an earlier job's program.
OpRef stage_upload(const std::vector<JobProgram>& programs, int64_t job);

}  // namespace roundpipe
