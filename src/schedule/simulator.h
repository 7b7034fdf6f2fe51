// The scheduler simulator: predicts how a plan runs on D modeled devices by
// driving the real scheduler (make_jobs, Dispatcher) on a virtual clock, and
// runs GPipe and 1F1B over the same costs with the same event engine, so that
// the comparison is like for like. Deterministic: equal inputs give equal
// results, bit for bit.
//
// The device model. Each device has four lanes, as in the engine: compute,
// parameter upload, activation upload and download. Work on one lane runs in
// the order it is issued (FIFO). The two upload lanes share the device's one
// host-to-device link, the download lane has the device-to-host link; a link
// carries one transfer at a time, taking bytes / link bandwidth, and when
// several transfers wait for a free link the one that became ready first
// goes first (then the one issued first). Transfers overlap compute.
//
// How RoundPipe is modeled: the simulator executes the engine's own lane
// programs (lane_program.h), so prefetch order, waits and slots are the
// engine's.
//  - Each iteration is one call per pass: kFused: forward_backward(); kTrain:
//    forward() then backward(); kInfer: forward(). Its jobs come from
//    make_jobs() and get devices from one Dispatcher over the D devices
//    (by predicted start from the costs, as the engine assigns from its
//    estimates, or round-robin: SimOptions::assignment), shared by all
//    iterations; make_lane_programs() gives each job its
//    program. With IterationOverlap::kFull (default) the host submits every
//    iteration at once, so each device's FIFO holds its jobs of all
//    iterations in submission order; kAfterLosses is what the engine does
//    by default (below), and with overlap_iterations off the engine
//    gets the single-iteration figure (docs/design/engine.md, B4).
//  - A device's worker issues its programs' operations in order and waits
//    only for a stage slot (kTakeSlot): everything it issues after a slot
//    wait starts after it. A slot is free once the fences of the job that
//    gave it back completed, i.e. the last task on each of its device's
//    lanes at that job's end. (Waiting for an input to be published, which
//    the engine's worker also does, is covered by the data dependency.)
//  - Compute of microbatch m costs, for a forward job, the sum of its
//    layers' fwd_ms, for the fused job fwd_ms + bwd_ms, for a backward job
//    recompute_ms + bwd_ms.
//  - Job j's input for microbatch m is job j-1's hand-off of m. On the same
//    device it stays there; otherwise the producer downloads it and the
//    consumer uploads it (activation upload lane), activation_bytes of the
//    layer before the boundary each way (gradients have the activation's
//    size). The model's inputs cost input_bytes to upload; the outputs of a
//    forward call and the gradients fed to a backward call cost output_bytes
//    each way; losses and input gradients returned to the host cost nothing.
//  - Forward jobs save the input of every layer that starts a (non-fused)
//    backward stage: a download when the forward pass reaches that layer
//    (compute is split there, so the trace shows one compute bar per
//    segment); the backward stage uploads it again before recomputing.
//    Layer 0's input stays where the caller gave it.
//  - A stage upload costs the sum of its layers' param_bytes; a gradient
//    download (fused and backward jobs, after their last compute) as much.
//  - Optionally the host optimizer steps once per iteration (optimizer_ms,
//    one step at a time) after every gradient of the iteration is on the
//    host; it runs one step behind, so the parameter uploads of iteration i
//    wait for the step of iteration i - 2. Not modeled by default.
//  - The executor (SimOptions::executor): an accelerator's worker issues
//    everything at once; a CPU device's worker runs each compute itself, so
//    the operations after a compute in its program are issued when it ends.
//    A copy delay (SimOptions::copy_delay_ms) holds each copy back from its
//    issue, as CPU devices' delayed lanes do (runtime/copy_lane.h).
// Not modeled: host CPU time outside the optimizer, kernel launch and memory
// allocation cost, buffers, labels, and memory limits other than the
// stage slots above.
//
// Units: milliseconds, bytes, link bandwidth in GB/s with 1 GB = 1e9 bytes.
// Trace events carry microseconds (trace.h).
//
// Thread-safety: pure functions of their arguments; results are values.
#pragma once

#include <roundpipe/auto_plan.h>
#include <roundpipe/plan.h>

#include <cstdint>
#include <string>
#include <vector>

#include "schedule/chrome_trace.h"
#include "schedule/scheduler.h"

namespace roundpipe {

// How a device's worker runs its lane program (lane_program.h).
enum class SimExecutor {
  // An accelerator: the worker only issues operations to its lanes (CUDA
  // streams) and blocks only for a stage slot.
  kAccelerator,
  // A CPU device: the worker runs each compute itself, waiting for its
  // inputs' fences, so it issues nothing more until that compute ended.
  kCpu,
};

// How one iteration's calls overlap the next's on the devices.
enum class IterationOverlap {
  // The host issues every iteration at once: the bound of what overlap can
  // give.
  kFull,
  // As the engine runs forward_backward: the next call is issued once the
  // previous one's losses are known (its last fused compute), and, with one
  // copy of the parameters, its upload of a layer waits until the previous
  // call's last upload of that layer completed (the step's write between
  // them is free here).
  kAfterLosses,
};

// How jobs get devices.
enum class SimAssignment {
  // The Dispatcher fed the simulated costs, as the engine feeds it its
  // timer's estimates: each job where it is predicted to start first.
  kPredictedStart,
  // The Dispatcher without times: round-robin (the engine's assignment
  // before every layer is timed).
  kRoundRobin,
  // SimOptions::given_devices: replays an assignment, e.g. a real run's
  // (from its trace).
  kGiven,
};

struct SimOptions {
  // Devices D. >= 1.
  int64_t num_devices = 1;
  // Microbatches M per iteration. >= 1.
  int64_t num_microbatch = 1;
  // The calls of one iteration (see the top of this file); the plan must be
  // valid for it.
  RunKind run_kind = RunKind::kFused;
  // Bandwidth of each device's link, per direction, GB/s. > 0; infinity
  // makes every transfer free.
  double link_gbps = 25.0;
  // Bytes per microbatch of the model's inputs, and of a forward call's
  // outputs (and of their gradients in kTrain). >= 0.
  int64_t input_bytes = 0;
  int64_t output_bytes = 0;
  // Only for kFused; kFull otherwise.
  IterationOverlap overlap = IterationOverlap::kFull;
  SimAssignment assignment = SimAssignment::kPredictedStart;
  // For kGiven: [call][job] the device of each job of a call, jobs in
  // make_jobs order; call k of the run uses entry k modulo the size.
  std::vector<std::vector<int64_t>> given_devices;
  // The devices' executor (see SimExecutor).
  SimExecutor executor = SimExecutor::kAccelerator;
  // Every copy starts no earlier than this long after its worker issued it,
  // ms (finite, >= 0), as on CPU devices with ROUNDPIPE_CPU_COPY_DELAY_US;
  // its link is then busy for bytes / bandwidth. Copies issued together
  // wait out their delays together.
  double copy_delay_ms = 0;
  // Host optimizer time per iteration, ms (finite, >= 0); 0: not modeled.
  // Only for kFused and kTrain.
  double optimizer_ms = 0;
  // Steady state: iterations 0..warmup_iterations-1 warm the pipeline up,
  // the next measured_iterations are measured, then two more iterations run
  // unmeasured so that the measured ones share the links as they would in a
  // longer run. measured_iterations 0 picks the smallest multiple of the
  // round-robin period (the iterations after which every job returns to the
  // same device: D / gcd(jobs per iteration, D)) that is at least 8.
  // warmup_iterations >= 0, measured_iterations >= 0.
  int64_t warmup_iterations = 4;
  int64_t measured_iterations = 0;
  // Shown as the "model" argument of trace events.
  std::string model_name;

  SimOptions& set_num_devices(int64_t v) {
    num_devices = v;
    return *this;
  }
  SimOptions& set_num_microbatch(int64_t v) {
    num_microbatch = v;
    return *this;
  }
  SimOptions& set_run_kind(RunKind v) {
    run_kind = v;
    return *this;
  }
  SimOptions& set_link_gbps(double v) {
    link_gbps = v;
    return *this;
  }
  SimOptions& set_input_bytes(int64_t v) {
    input_bytes = v;
    return *this;
  }
  SimOptions& set_output_bytes(int64_t v) {
    output_bytes = v;
    return *this;
  }
  SimOptions& set_overlap(IterationOverlap v) {
    overlap = v;
    return *this;
  }
  SimOptions& set_assignment(SimAssignment v) {
    assignment = v;
    return *this;
  }
  SimOptions& set_given_devices(std::vector<std::vector<int64_t>> v) {
    given_devices = std::move(v);
    return *this;
  }
  SimOptions& set_executor(SimExecutor v) {
    executor = v;
    return *this;
  }
  SimOptions& set_copy_delay_ms(double v) {
    copy_delay_ms = v;
    return *this;
  }
  SimOptions& set_optimizer_ms(double v) {
    optimizer_ms = v;
    return *this;
  }
  SimOptions& set_warmup_iterations(int64_t v) {
    warmup_iterations = v;
    return *this;
  }
  SimOptions& set_measured_iterations(int64_t v) {
    measured_iterations = v;
    return *this;
  }
  SimOptions& set_model_name(std::string v) {
    model_name = std::move(v);
    return *this;
  }
};

// Outcome of one simulation. "Bubble" is the idle fraction of device compute
// time: 1 - (compute time of all devices) / (D * elapsed time).
struct SimResult {
  int64_t num_devices = 0;
  int64_t num_microbatch = 0;
  int64_t iterations = 0;           // simulated in the run `events` shows
  int64_t measured_iterations = 0;  // in the steady-state window
  double makespan_ms = 0;           // end of the run's last task
  std::vector<double> busy_ms;      // [device] compute time in the whole run

  // Steady state. RoundPipe: with C_i the end of iteration i's last task
  // (compute or transfer), the window runs from C_{w-1} (0 when w = 0) to
  // C_{w+n-1}, w warm-up and n measured iterations; iteration_ms is the
  // window's length / n, bubble the idle fraction of device compute time
  // inside the window. GPipe and 1F1B flush every iteration, so there the
  // steady state is one iteration.
  double iteration_ms = 0;
  double throughput = 0;  // microbatches per second: M / iteration_ms
  double bubble = 0;

  // One iteration simulated alone, from time 0 to its last task's end.
  double single_iteration_ms = 0;
  double single_throughput = 0;
  double single_bubble = 0;

  // Every task of the run, in the order it was issued: compute ("compute",
  // one per microbatch and segment), parameter uploads ("upload"),
  // activations and saved inputs ("handoff"), gradient downloads
  // ("download"), optimizer steps ("optimizer", device -1). `call` counts
  // the calls of the run from 0; `job` and `stage` name the job. Zero-byte
  // transfers are not tasks.
  std::vector<TraceEvent> events;
};

// Gives the `jobs` of the run's call number `call` their devices as the
// simulator does under `options` (assignment, overlap, microbatches): from
// `dispatcher` fed `costs`, or from options.given_devices. Throws
// c10::ValueError when a given assignment does not fit the call.
void assign_devices(Dispatcher& dispatcher, std::vector<JobSpec>& jobs, const LayerCosts& costs,
                    const SimOptions& options, int64_t call);

// Simulates `plan` for a model with `costs` (see the top of this file).
// Throws c10::ValueError, saying what is wrong and how to fix it, when an
// option is out of range, the costs are invalid (lengths, negative or
// non-finite values) or the plan is not valid for options.run_kind.
SimResult simulate_roundpipe(const LayerCosts& costs, const ModelExecutePlan& plan,
                             const SimOptions& options);

enum class PipelineSchedule {
  kGPipe,  // every forward, then every backward (microbatch order)
  k1F1B,   // stage i: min(p - i - 1, M) forwards, then one forward one backward, then the rest
};

// "GPipe", "1F1B".
const char* pipeline_schedule_name(PipelineSchedule schedule);

// Per-microbatch costs of p pipeline stages; stage i runs on device i.
struct StageCosts {
  std::vector<double> fwd_ms;
  std::vector<double> bwd_ms;  // includes recomputation where the stage recomputes
  // Bytes of stage i's output (and of the gradient sent back for it), per
  // microbatch. May be empty (all 0).
  std::vector<int64_t> output_bytes;
};

// Splits the layers of `costs` into `num_stages` contiguous stages with the
// smallest largest per-microbatch stage time (fwd + bwd, plus recompute when
// `recompute`); among equal splits the last boundary comes as early as it
// may, then the one before it, and so on. fwd_ms is
// the sum of fwd_ms, bwd_ms the sum of bwd_ms (+ recompute_ms), output_bytes
// the activation_bytes of the stage's last layer. Throws c10::ValueError for
// invalid costs or num_stages outside [1, number of layers].
StageCosts split_pipeline_stages(const LayerCosts& costs, int64_t num_stages,
                                 bool recompute = true);

// Simulates one iteration of `schedule` over p = stages.fwd_ms.size() devices
// and `num_microbatch` microbatches with the device model above: parameters
// stay on their device (no parameter or gradient traffic); activations and
// gradients between neighbouring stages go down and up over the links.
// Steady-state figures equal the single-iteration ones (one flush per
// iteration). Throws c10::ValueError for empty or mismatched costs, negative
// or non-finite values, num_microbatch < 1 or link_gbps <= 0.
SimResult simulate_pipeline(PipelineSchedule schedule, const StageCosts& stages,
                            int64_t num_microbatch, double link_gbps);

}  // namespace roundpipe
