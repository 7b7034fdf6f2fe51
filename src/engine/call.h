// One call's pipeline: its jobs and their lane programs, the values flowing
// between them, and its outcome. Shared by the user thread and the device workers running its jobs.
//
// Thread-safety: every field below `mu` is guarded by it; the rest is set
// before the jobs are submitted and read-only afterwards (except where noted).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/autocast_state.h"
#include "engine/buffer_handoff.h"
#include "engine/gradient_sums.h"
#include "engine/layer_handle.h"
#include "engine/param_gate.h"
#include "engine/recompute_context.h"
#include "roundpipe/model.h"
#include "roundpipe/timer.h"
#include "runtime/device.h"
#include "schedule/chrome_trace.h"
#include "schedule/lane_program.h"
#include "schedule/scheduler.h"
#include "util/contextual_error.h"
#include "util/countdown.h"

namespace roundpipe {

class HostStore;

// A value handed from one job to the next (or to/from the host).
struct Slot {
  c10::IValue value;
  int64_t device = -1;  // pool index of the device holding it; -1: host
  FencePtr fence;       // the value is valid once this completes (null: now)
  bool ready = false;
};

// What forward stages keep for the backward stages (host memory).
struct ForwardRecord {
  int64_t call_id = 0;
  AutocastState autocast;  // the caller's, when the record was made: forward, recompute and loss run under it
  int64_t num_microbatch = 0;
  std::vector<std::vector<Slot>> stage_inputs;  // [layer][M]: inputs of layers that start a backward stage
  // [layer][M]: what save_for_recompute kept, on the host once each slot's fence completes.
  std::vector<std::vector<c10::optional<std::vector<Slot>>>> recompute_data;
};

// Everything a job needs from its model, fixed for the call.
struct ModelView {
  std::string name;
  std::vector<std::shared_ptr<LayerHandle>>* layers;
  const HostStore* store;
  uint64_t seed;
  // Added to microbatch indices in random-stream keys: with data parallelism,
  // process r's microbatch m draws as microbatch r * M + m of one process.
  int64_t microbatch_offset;
  // Uploads of layer l wait until the parameters hold write `generation`
  // (the latest step's optimizer -> model copy issued before the call).
  const ParamGate* gate;
  int64_t generation;
  // Where uploads read the layers' buffers: what an earlier call still
  // running left (its forward's, once downloaded); null: the host buffers.
  std::shared_ptr<const BufferHandoff> buffer_source;
};

// The tensors of one stage on one device, uploaded in one batch.
struct StageTensors {
  std::vector<std::vector<at::Tensor>> params;   // [layer in stage][param]
  std::vector<std::vector<at::Tensor>> buffers;  // [layer in stage][buffer]
  // [layer in stage][buffer]: the host tensors the buffers were uploaded
  // from (the host buffers, or what an earlier call published), complete.
  std::vector<std::vector<at::Tensor>> buffer_sources;
  FencePtr uploaded;                             // the upload is complete after this (null: nothing uploaded)
  bool holds_slot = false;                       // took one of its device's stage slots
  int64_t bytes = 0;                             // uploaded
  MarkPtr start, end;                            // of the upload, when timed
  MarkPtr gate_start;  // when timed and the upload waited for the optimizer: the wait's start (it ends at `start`)
};

// One timed piece of a job's work on its device (for traces).
struct SpanRecord {
  TraceLane lane;
  const char* kind;   // trace.h kinds: "upload", "compute", "download", "handoff", "wait"
  const char* label;  // "params", "fwd", "fused", "bwd", "grads", "buffers", "act", "gate"
  int64_t job;       // the job it belongs to (a prefetch is the next job's upload)
  int64_t microbatch;
  int64_t bytes;
  MarkPtr start, end;
};

// The time of `action` on layers [layers.begin, layers.end) for one
// microbatch; several layers when their boundary could not be timed (the
// time is then split in proportion to their forward time).
struct LayerTimeRecord {
  LayerRange layers;
  LayerAction action;
  int64_t microbatch;
  MarkPtr start, end;
};

// What one job recorded; written only by the device running the job.
struct JobRecord {
  std::vector<SpanRecord> spans;             // only when tracing
  std::vector<LayerTimeRecord> layer_times;  // always (per-layer timing)
};

class Call {
 public:
  ModelView model;
  int64_t call_id = 0;
  int64_t num_microbatch = 0;
  RecomputeGrain grain = RecomputeGrain::kStage;
  bool preserve_rng = true;
  bool saves_for_backward = false;  // forward stages keep inputs for backward stages
  std::vector<JobSpec> jobs;
  std::vector<JobProgram> programs;       // [job]: what it does on its device (set with the devices)
  std::shared_ptr<ForwardRecord> record;  // written by forward stages, read by backward ones
  std::vector<char> backward_starts;      // [layer]: a backward (non-fused) stage starts here
  std::vector<c10::IValue> labels;        // [M] (fused calls)
  LossFn loss_fn;                         // fused calls (held by value: the call may outlive the caller's)
  bool keep_outputs = false;              // fused calls: return the outputs too
  bool trace = false;                     // record spans for the timeline trace
  // The buffers this call's forward leaves, for the calls issued while it
  // runs (null: none will be); failed with the call.
  std::shared_ptr<BufferHandoff> buffer_out;

  // flow[j][m]: input of job j for microbatch m; flow[jobs.size()][m]: result
  // of the last job (outputs on the host, or input gradients).
  std::vector<std::vector<Slot>> flow;
  std::vector<StageTensors> prefetched;  // [job]: written and read by the job's device only

  // Results, each written by exactly one job, read after the call finished.
  std::vector<c10::IValue> losses;   // [M] host
  std::vector<c10::IValue> outputs;  // [M] host (fused calls with keep_outputs)
  std::vector<std::vector<std::pair<int64_t, at::Tensor>>> grads;  // [job]: (param id, host grad)
  std::vector<std::vector<std::pair<int64_t, std::vector<at::Tensor>>>> buffers;  // [job]: (layer, host buffers)
  // [job]: every copy the job issued (uploads reading host memory, downloads
  // writing it) is complete after these; the call waits for them all.
  std::vector<std::vector<FencePtr>> fences;
  std::vector<JobRecord> records;  // [job]: timing
  // [layer]: the jobs of the call whose stage uploads read the layer's host
  // parameters, in job order; set before the jobs are submitted. Every one
  // counts: a later job's upload (a prefetch on another device) may complete
  // before an earlier job's.
  std::vector<std::vector<int64_t>> readers;

  void init_flow();
  // readers from the jobs (a stage reads its layers and the owners of the
  // tied parameters it uses).
  void find_readers();
  // Blocks until `slot` is ready; throws Cancelled if the call failed.
  Slot wait(const Slot& slot);
  // wait() for a job's input slot, whose only consumer the job is: the value
  // moves out of the slot, so its memory (on a device, or a page-locked host
  // block) goes when the job is done with it rather than with the call.
  Slot take(Slot& slot);
  void publish(Slot& slot, Slot value);
  void fail(std::exception_ptr error, const std::string& context);
  bool failed();
  void job_done();
  // Blocks until every job finished and every copy it issued completed;
  // rethrows the first error with context.
  void wait_all();

  // Job `job` issued its stage upload, complete after `fence` (null: now).
  void stage_uploaded(int64_t job, FencePtr fence);
  // Blocks until nothing of this call reads layer `layer`'s host parameters
  // any more: each reader's upload completed, or every job finished.
  void wait_read(int64_t layer);
  // The fused job handed microbatch m's loss (and outputs) to the host,
  // complete after `fence`.
  void loss_handed(FencePtr fence);
  // Blocks until every microbatch's loss is on the host; false when the call
  // failed first (wait_all() then says why). Interruptible like wait_all.
  bool wait_losses();
  // After wait_all(): the gradients the jobs downloaded, moved out of the
  // call (so they are freed with their sum, not with the call).
  CallGradients take_gradients();

 private:
  // Waits until every job finished and every copy of the call completed or
  // failed: nothing of the call reads host memory any more.
  void wait_until_no_copy_runs();
  std::mutex mu_;
  // Two conditions, so that a value handed between workers does not wake the
  // host, nor a job's progress the workers: `slots_cv_` for the workers'
  // wait() and take(), `host_cv_` for wait_read() and wait_losses().
  std::condition_variable slots_cv_;
  std::condition_variable host_cv_;
  std::exception_ptr error_;  // guarded by mu_
  std::string context_;       // guarded by mu_
  Countdown jobs_done_;       // the last job's finish is its last use of the call
  int64_t finished_jobs_ = 0;              // guarded by mu_
  std::vector<char> uploaded_;             // guarded by mu_: [job] its stage upload was issued
  std::vector<FencePtr> upload_fences_;    // guarded by mu_: [job]
  std::vector<FencePtr> loss_fences_;      // guarded by mu_: one per microbatch handed
};

// Thrown inside a job when another job of its call failed first.
struct Cancelled {};


}  // namespace roundpipe
