// The RoundPipe simulation: the engine's calls, jobs and lane programs on the
// simulator's modeled devices (simulator.h, sim_timeline.h).
#include "schedule/simulator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <queue>
#include <string>
#include <utility>

#include "schedule/lane_program.h"
#include "schedule/scheduler.h"
#include "schedule/sim_timeline.h"

namespace roundpipe {
namespace {

using sim::bubble;
using sim::EventEngine;
using sim::kNone;
using sim::throughput;
using sim::Timeline;

// ---- RoundPipe ----

// A value between jobs: on `device` (-1: the host) once `task` ends; moving
// it to a device takes `bytes` over the link.
struct Value {
  int task = kNone;
  int64_t device = -1;
  int64_t bytes = 0;
};

// The calls of one iteration.
std::vector<CallKind> calls_of(RunKind kind) {
  if (kind == RunKind::kFused) return {CallKind::kFused};
  if (kind == RunKind::kTrain) return {CallKind::kForward, CallKind::kBackward};
  return {CallKind::kForward};
}

std::string range_str(const LayerRange& r) {
  return "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")";
}

class RoundPipeSim {
 public:
  RoundPipeSim(const LayerCosts& costs, const ModelExecutePlan& plan, const SimOptions& o)
      : c_(costs),
        plan_(plan),
        o_(o),
        tl_(o.num_devices, o.link_gbps, o.copy_delay_ms),
        dispatcher_(o.num_devices),
        host_(o.num_devices, kNone),
        slots_(o.num_devices) {}

  // Adds `iterations` iterations, then runs them.
  Timeline& run(int64_t iterations) {
    for (int64_t it = 0; it < iterations; ++it) add_iteration(it);
    tl_.run();
    return tl_;
  }

 private:
  // What an iteration's calls share.
  struct Iteration {
    std::map<int64_t, std::vector<Value>> saved;  // [layer][m]: saved stage inputs on the host
    std::vector<Value> outputs;                   // [m]: the forward call's outputs (kTrain)
    std::vector<int> grads;                       // gradient downloads
  };

  // A device's stage slots, as Device::take_stage_slot keeps them.
  struct Slots {
    int in_use = 0;
    std::deque<int> given_back;  // give-back steps whose fences a take may wait for
  };

  // One call being added: its jobs, their programs, the task of every op.
  struct CallState {
    CallKind kind;
    std::vector<JobSpec> jobs;
    std::vector<JobProgram> programs;
    std::vector<std::vector<int>> task;   // [job][op]
    std::vector<char> saves;              // [layer]: forward jobs save this layer's input
    std::vector<Value> in;                // [m]: the call's inputs
    std::vector<std::vector<Value>> out;  // [job][m]: what each job hands on
  };

  int64_t act(int64_t layer) const {  // bytes handed on after `layer`
    return c_.activation_bytes.empty() ? 0 : c_.activation_bytes[layer];
  }

  void add_iteration(int64_t it) {
    tl_.set_iteration(it);
    Iteration iter;
    const int64_t m = o_.num_microbatch;
    if (o_.overlap == IterationOverlap::kAfterLosses && losses_known_ != kNone) {
      // The caller issues this iteration once the previous call returned.
      for (int64_t d = 0; d < o_.num_devices; ++d)
        host_[d] = tl_.host_step(d, {host_[d], losses_known_});
    }
    if (o_.overlap == IterationOverlap::kAfterLosses) {
      previous_uploads_ = last_uploads_;
      last_uploads_.assign(c_.num_layers(), kNone);
    }
    for (CallKind kind : calls_of(o_.run_kind)) {
      CallState call;
      call.kind = kind;
      call.jobs = make_jobs(plan_, kind);
      assign_devices(dispatcher_, call.jobs, c_, o_, call_);
      call.programs = make_lane_programs(call.jobs, m);
      call.task.resize(call.jobs.size());
      call.out.assign(call.jobs.size(), std::vector<Value>(m));
      call.saves.assign(c_.num_layers(), 0);
      if (kind != CallKind::kBackward && o_.run_kind != RunKind::kInfer) {
        const size_t first = kind == CallKind::kFused ? 1 : 0;  // the fused stage saves nothing
        for (size_t s = first; s < plan_.bwd_plan.size(); ++s)
          call.saves[plan_.bwd_plan[s].begin] = 1;
      }
      call.in.assign(m, Value{kNone, -1, o_.input_bytes});
      if (kind == CallKind::kBackward) {
        for (int64_t i = 0; i < m; ++i)
          call.in[i] = Value{iter.outputs[i].task, -1, o_.output_bytes};
      }
      for (size_t j = 0; j < call.jobs.size(); ++j) add_job(call, j, iter);
      if (kind == CallKind::kForward) iter.outputs = call.out.back();
      ++call_;
    }
    if (o_.optimizer_ms > 0) {
      TraceEvent e;
      e.kind = "optimizer";
      e.name = "step " + std::to_string(it);
      e.model = o_.model_name;
      const int step = tl_.add(-1, TraceLane::kOptimizer, o_.optimizer_ms, e);
      for (int g : iter.grads) tl_.depend(step, g);
      steps_.push_back(step);
    }
  }

  TraceEvent describe(const JobSpec& job, const char* kind, std::string name, LayerRange layers,
                      int64_t microbatch) const {
    TraceEvent e;
    e.kind = kind;
    e.name = std::move(name);
    e.model = o_.model_name;
    e.call = call_;
    e.job = job_kind_name(job.kind);
    e.stage = job.stage;
    e.layer_begin = layers.begin;
    e.layer_end = layers.end;
    e.microbatch = microbatch;
    return e;
  }

  static std::string job_tag(const JobSpec& job) {
    return std::string(job_kind_name(job.kind)).substr(0, 3) + " s" + std::to_string(job.stage);
  }

  // A task that `d`'s worker issues: it starts no earlier than the worker's
  // last wait for a slot.
  int issued(int64_t d, int task) {
    if (task != kNone && host_[d] != kNone) tl_.depend(task, host_[d]);
    return task;
  }

  // `v` on device `d`: the task after which it is there.
  int to_device(int64_t d, const Value& v, TraceEvent event) {
    if (v.device == d) return v.task;
    TORCH_INTERNAL_ASSERT(v.device == -1,
                          "simulator: a value moves between devices without the host");
    return tl_.transfer(d, TraceLane::kActUpload, v.bytes, v.task, host_[d], std::move(event));
  }

  // A value made on `d` by `task`, handed to `consumer` (-1: the host).
  Value hand_off(int64_t d, int task, int64_t bytes, int64_t consumer, TraceEvent event) {
    if (consumer == d) return Value{task, d, bytes};
    return Value{tl_.transfer(d, TraceLane::kDownload, bytes, task, host_[d], std::move(event)), -1,
                 bytes};
  }

  int compute(int64_t d, double ms, const std::vector<int>& deps, TraceEvent event) {
    const int id = issued(d, tl_.add(d, TraceLane::kCompute, ms, std::move(event)));
    for (int dep : deps) tl_.depend(id, dep);
    // A CPU device's worker runs the compute: it issues its next operation
    // only after this one ended.
    if (o_.executor == SimExecutor::kCpu) host_[d] = id;
    return id;
  }

  double sum(const std::vector<double>& a, const std::vector<double>* b, LayerRange r) const {
    double t = 0;
    for (int64_t l = r.begin; l < r.end; ++l) t += a[l] + (b ? (*b)[l] : 0.0);
    return t;
  }

  int64_t param_bytes(LayerRange r) const {
    int64_t bytes = 0;
    for (int64_t l = r.begin; l < r.end; ++l) bytes += c_.param_bytes[l];
    return bytes;
  }

  // Executes job j's lane program on the virtual clock: one task per
  // transfer and compute segment, host steps for the slots.
  void add_job(CallState& call, size_t j, Iteration& iter) {
    const JobSpec& job = call.jobs[j];
    const int64_t d = job.device;
    const LayerRange r = job.layers;
    const std::string tag = job_tag(job);
    const int64_t next = j + 1 < call.jobs.size() ? call.jobs[j + 1].device : -1;
    std::vector<int>& task = call.task[j];
    auto task_of = [&](const OpRef& ref) { return call.task[ref.job][ref.index]; };
    std::vector<std::vector<int>> inputs(o_.num_microbatch);  // [m]: the input uploads
    int last_compute = kNone;
    for (const LaneOp& op : call.programs[j].ops) {
      const int64_t m = op.microbatch;
      const std::string mb = " mb" + std::to_string(m);
      int t = kNone;
      switch (op.kind) {
        case OpKind::kTakeSlot: {
          Slots& slots = slots_[d];
          ++slots.in_use;
          std::vector<int> waits{host_[d]};
          while (!slots.given_back.empty() &&
                 slots.in_use + static_cast<int>(slots.given_back.size()) > kStageSlots) {
            waits.push_back(slots.given_back.front());
            slots.given_back.pop_front();
          }
          t = host_[d] = tl_.host_step(d, waits);
          break;
        }
        case OpKind::kUploadStage: {
          const JobSpec& owner = call.jobs[op.job];
          const int64_t bytes = param_bytes(owner.layers);
          // One step behind: this iteration's parameters wait for the step two before.
          const int step =
              steps_.empty() || tl_.iteration() < 2 ? kNone : steps_[tl_.iteration() - 2];
          // One copy of the parameters: the step's write of a layer, which
          // this upload reads, waits until the previous call's last upload
          // of that layer completed.
          std::vector<int> written{task_of(op.after.at(0)), step};
          if (o_.overlap == IterationOverlap::kAfterLosses && !previous_uploads_.empty()) {
            for (int64_t l = owner.layers.begin; l < owner.layers.end; ++l)
              written.push_back(previous_uploads_[l]);
          }
          if (bytes > 0) {
            t = tl_.transfer(d, TraceLane::kParamUpload, bytes, task_of(op.after.at(0)), host_[d],
                             describe(owner, "upload",
                                      "params " + job_tag(owner) + " " + range_str(owner.layers),
                                      owner.layers, -1));
            for (int w : written) tl_.depend(t, w);
          } else {  // free parameters are still the optimizer's output
            t = tl_.host_step(d, written);
          }
          if (o_.overlap == IterationOverlap::kAfterLosses) {
            for (int64_t l = owner.layers.begin; l < owner.layers.end; ++l) last_uploads_[l] = t;
          }
          break;
        }
        case OpKind::kUploadInput: {
          const Value& in = j == 0 ? call.in[m] : call.out[j - 1][m];
          inputs[m].push_back(to_device(d, in, describe(job, "handoff", "in " + tag + mb, r, m)));
          if (job.kind == JobKind::kBackward) {
            inputs[m].push_back(
                to_device(d, iter.saved.at(r.begin)[m],
                          describe(job, "handoff", "saved input " + tag + mb, r, m)));
          }
          t = inputs[m].back();
          break;
        }
        case OpKind::kCompute: {
          std::vector<int> deps = inputs[m];
          for (const OpRef& ref : op.after) {
            if (call.programs[ref.job].ops[ref.index].kind == OpKind::kUploadStage)
              deps.push_back(task_of(ref));
          }
          if (job.kind == JobKind::kForward) {
            // Compute is split where a layer's input is saved for the backward pass.
            int64_t begin = r.begin;
            for (int64_t l = r.begin; l <= r.end; ++l) {
              if (l > begin && (l == r.end || call.saves[l])) {
                const LayerRange seg{begin, l};
                t = compute(d, sum(c_.fwd_ms, nullptr, seg), deps,
                            describe(job, "compute", tag + mb + " " + range_str(seg), seg, m));
                deps = {t};
                begin = l;
              }
              if (l < r.end && call.saves[l]) {  // layer 0's input stays on the host
                iter.saved[l].resize(o_.num_microbatch);
                iter.saved[l][m] =
                    l == 0 ? (j == 0 ? call.in[m] : call.out[j - 1][m])
                           : hand_off(
                                 d, t, act(l - 1), -1,
                                 describe(job, "handoff", "save L" + std::to_string(l) + mb, r, m));
              }
            }
          } else {
            const double ms = job.kind == JobKind::kBackward ? sum(c_.recompute_ms, &c_.bwd_ms, r)
                                                             : sum(c_.fwd_ms, &c_.bwd_ms, r);
            t = compute(d, ms, deps, describe(job, "compute", tag + mb, r, m));
          }
          last_compute = t;
          if (job.kind == JobKind::kFused && m == o_.num_microbatch - 1) losses_known_ = t;
          break;
        }
        case OpKind::kHandOff: {
          int64_t bytes;
          if (job.kind == JobKind::kForward) {
            bytes = r.end == c_.num_layers() ? o_.output_bytes : act(r.end - 1);
          } else {  // input gradients; what goes back to the caller costs nothing
            bytes = r.begin == 0 ? 0 : act(r.begin - 1);
          }
          const char* what = job.kind == JobKind::kForward ? "out " : "grad ";
          call.out[j][m] = hand_off(d, task_of(op.after.at(0)), bytes, next,
                                    describe(job, "handoff", what + tag + mb, r, m));
          t = call.out[j][m].task;
          break;
        }
        case OpKind::kDownloadGrads:
          t = tl_.transfer(d, TraceLane::kDownload, param_bytes(r), last_compute, host_[d],
                           describe(job, "download", "grads " + tag, r, -1));
          iter.grads.push_back(t);
          break;
        case OpKind::kDownloadBuffers:  // buffers are not modeled
          t = last_compute;
          break;
        case OpKind::kGiveBackSlot: {
          std::vector<int> ends = tl_.lane_ends(d);
          ends.push_back(host_[d]);
          t = tl_.host_step(d, ends);
          --slots_[d].in_use;
          slots_[d].given_back.push_back(t);
          break;
        }
      }
      task.push_back(t);
    }
  }

  const LayerCosts& c_;
  const ModelExecutePlan& plan_;
  const SimOptions& o_;
  Timeline tl_;
  Dispatcher dispatcher_;
  std::vector<int> host_;     // [device]: its worker's last slot wait
  std::vector<Slots> slots_;  // [device]
  std::vector<int> steps_;    // [iteration]: optimizer steps
  // IterationOverlap::kAfterLosses: the task after which the latest call's losses
  // are known, and per layer the last upload of the current and of the
  // previous iteration.
  int losses_known_ = kNone;
  std::vector<int> last_uploads_, previous_uploads_;
  int64_t call_ = 0;
};

void check_options(const SimOptions& o) {
  TORCH_CHECK_VALUE(o.num_devices >= 1, "simulator: num_devices must be >= 1, got ", o.num_devices);
  TORCH_CHECK_VALUE(o.num_microbatch >= 1, "simulator: num_microbatch must be >= 1, got ",
                    o.num_microbatch);
  TORCH_CHECK_VALUE(o.link_gbps > 0, "simulator: link_gbps must be > 0 GB/s, got ", o.link_gbps,
                    " (use infinity for free transfers)");
  TORCH_CHECK_VALUE(o.input_bytes >= 0 && o.output_bytes >= 0,
                    "simulator: input_bytes and output_bytes must be >= 0, got ", o.input_bytes,
                    " and ", o.output_bytes);
  TORCH_CHECK_VALUE(std::isfinite(o.optimizer_ms) && o.optimizer_ms >= 0,
                    "simulator: optimizer_ms must be finite and >= 0 (0: not modeled), got ",
                    o.optimizer_ms);
  TORCH_CHECK_VALUE(o.optimizer_ms == 0 || o.run_kind != RunKind::kInfer,
                    "simulator: optimizer_ms is for training; set it to 0 for RunKind::kInfer");
  TORCH_CHECK_VALUE(std::isfinite(o.copy_delay_ms) && o.copy_delay_ms >= 0,
                    "simulator: copy_delay_ms must be finite and >= 0 (0: none), got ",
                    o.copy_delay_ms);
  TORCH_CHECK_VALUE(o.warmup_iterations >= 0 && o.measured_iterations >= 0,
                    "simulator: warmup_iterations and measured_iterations must be >= 0, got ",
                    o.warmup_iterations, " and ", o.measured_iterations,
                    " (measured_iterations 0 picks a count)");
}

}  // namespace

void assign_devices(Dispatcher& dispatcher, std::vector<JobSpec>& jobs, const LayerCosts& costs,
                    const SimOptions& options, int64_t call) {
  if (options.assignment == SimAssignment::kGiven) {
    TORCH_CHECK_VALUE(!options.given_devices.empty(),
                      "simulator: assignment kGiven needs given_devices, one device list per call");
    const std::vector<int64_t>& given =
        options.given_devices[static_cast<size_t>(call) % options.given_devices.size()];
    TORCH_CHECK_VALUE(given.size() == jobs.size(), "simulator: given_devices for call ", call,
                      " has ", given.size(), " devices for ", jobs.size(),
                      " jobs; give one per job");
    for (size_t j = 0; j < jobs.size(); ++j) {
      TORCH_CHECK_VALUE(given[j] >= 0 && given[j] < options.num_devices,
                        "simulator: given_devices for call ", call, " puts job ", j, " on device ",
                        given[j], "; devices are 0..", options.num_devices - 1);
      jobs[j].device = given[j];
    }
    return;
  }
  if (options.assignment == SimAssignment::kRoundRobin) {
    dispatcher.assign(jobs, options.num_devices);
    return;
  }
  dispatcher.assign(jobs, options.num_devices, job_times_ms(jobs, costs), options.num_microbatch,
                    options.overlap == IterationOverlap::kAfterLosses ? CallIssue::kAtLosses
                                                                      : CallIssue::kAtOnce);
}

SimResult simulate_roundpipe(const LayerCosts& costs, const ModelExecutePlan& plan,
                             const SimOptions& options) {
  check_options(options);
  worst_stage_ms(plan, costs, options.run_kind);  // validates the costs and the plan

  // The round-robin period: iterations until every job is on its device again.
  int64_t jobs = 0;
  for (CallKind kind : calls_of(options.run_kind)) {
    jobs += static_cast<int64_t>(make_jobs(plan, kind).size());
  }
  const int64_t period = options.num_devices / std::gcd(jobs, options.num_devices);
  const int64_t w = options.warmup_iterations;
  const int64_t n = options.measured_iterations > 0 ? options.measured_iterations
                                                    : period * ((8 + period - 1) / period);
  const int64_t iterations = w + n + 2;

  RoundPipeSim sim(costs, plan, options);
  const Timeline& tl = sim.run(iterations);
  SimResult r = tl.summary(options.num_microbatch);
  r.iterations = iterations;
  r.measured_iterations = n;
  const std::vector<double> ends = tl.iteration_ends(iterations);
  const double from = w == 0 ? 0.0 : ends[w - 1];
  const double to = ends[w + n - 1];
  // Iterations on different devices can end together; whole periods cannot.
  TORCH_CHECK_VALUE(to > from || to == 0, "simulator: the measured iterations ", w, "..", w + n - 1,
                    " end no later than iteration ", w - 1,
                    ", so they span no time; measure a multiple of the round-robin period (",
                    period, " iterations here), or set measured_iterations to 0 to pick one");
  r.iteration_ms = (to - from) / static_cast<double>(n);
  r.throughput = throughput(options.num_microbatch, r.iteration_ms);
  r.bubble = bubble(tl.busy_between(from, to), options.num_devices, to - from);

  RoundPipeSim alone(costs, plan, options);
  const SimResult one = alone.run(1).summary(options.num_microbatch);
  r.single_iteration_ms = one.single_iteration_ms;
  r.single_throughput = one.single_throughput;
  r.single_bubble = one.single_bubble;
  return r;
}

}  // namespace roundpipe
