// RoundPipe's state, shared by the calls (roundpipe.cpp) and the optimizer
// side (optimizer_side.cpp).
//
// Thread-safety: owned by the model's user thread, except the optimizer
// members, which the optimizer thread uses as documented below.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <malloc.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/call.h"
#include "engine/job_runner.h"
#include "engine/call_timing.h"
#include "engine/data_parallel.h"
#include "engine/host_store.h"
#include "engine/layer.h"
#include "engine/param_gate.h"
#include "engine/planner.h"
#include "engine/rng.h"
#include "engine/tracer.h"
#include "engine/value_tree.h"
#include "roundpipe/auto_plan.h"
#include "roundpipe/model.h"
#include "roundpipe/optimizer.h"
#include "roundpipe/timer.h"
#include "runtime/device_pool.h"
#include "util/worker_thread.h"

namespace roundpipe {

class RoundPipe::Impl : public std::enable_shared_from_this<RoundPipe::Impl> {
 public:
  // The only way to make one: its last owner may let go on any thread.
  static std::shared_ptr<Impl> create(std::vector<std::shared_ptr<Layer>> layers, RoundPipeOptions options,
                                      torch::nn::Sequential seq);

 private:
  // The devices a model with RoundPipeOptions::max_devices `max` uses.
  static int64_t devices_of(int64_t max) {
    const int64_t pool = DevicePool::instance().size();
    TORCH_CHECK_VALUE(max >= 0 && max <= pool, "RoundPipe: max_devices must be in 0..", pool,
                      " (0 = all devices of the pool), got ", max);
    return max == 0 ? pool : max;
  }

  Impl(std::vector<std::shared_ptr<Layer>> layers_in, RoundPipeOptions options,
       torch::nn::Sequential seq_in)
      : name(std::move(options.name)),
        defaults(std::move(options.run_config)),
        seq(std::move(seq_in)),
        layers(std::move(layers_in)),
        timer(static_cast<int64_t>(layers.size())),
        overlap_iterations(options.overlap_iterations),
        sync_warmup_steps(options.sync_warmup_steps.value_or(get_sync_warmup_steps())),
        num_devices(devices_of(options.max_devices)),
        planner(num_devices, overlap_iterations) {
    TORCH_CHECK_VALUE(!layers.empty(), "RoundPipe: the model has no layers");
    TORCH_CHECK_VALUE(sync_warmup_steps >= 0, "RoundPipe: sync_warmup_steps must be >= 0, got ", sync_warmup_steps);
    DevicePool& pool = DevicePool::instance();
    Tracer::instance();  // starts tracing when ROUNDPIPE_TRACE is set
    for (const auto& layer : layers) layer->make_replicas(static_cast<int>(num_devices));
    if (options.seed) {
      seed = *options.seed;
    } else {
      std::lock_guard<std::mutex> lock(cpu_generator_lock());  // devices may be mid keyed run
      seed = static_cast<uint64_t>(at::empty({}, at::kLong).random_().item<int64_t>());
    }
    const bool page_lock = !pool.device(0).torch_device().is_cpu();
    store = std::make_unique<HostStore>(layers, options.pin_model, page_lock);
    if (options.process_group) {
      group = options.process_group;
      reduction = options.gradient_reduction;
      // The optimizer thread does not exist yet: drain only once it does.
      attachment = std::make_unique<GroupAttachment>(group, name, [this] {
        if (optimizer_thread) drain_optimizer();
      });
      broadcast_model_state(*group, *store, layers, seed);  // every process starts from rank 0's state
    }
    if (defaults.num_microbatch()) check_num_microbatch(*defaults.num_microbatch());
    if (defaults.execute_plan()) check_model_plan(*defaults.execute_plan());
    param_gate = std::make_unique<ParamGate>(num_layers());
    for (const auto& l : layers) has_buffers = has_buffers || !l->named_buffers().empty();
    make_optimizer_copies(options.optim_dtype);
    // Packing into arenas and cloning replicas freed about the model's size
    // of heap memory: give it back to the system rather than keep it resident.
    malloc_trim(0);
  }

 public:

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // A plan in the model's run config: checked for the calls it can serve
  // (forward_backward when its forward part stops before the last layer);
  // each call checks it again for its own kind.
  void check_model_plan(const ModelExecutePlan& plan) const {
    const bool fused = !plan.fwd_plan.empty() ? plan.fwd_plan.back().end < num_layers() : !plan.bwd_plan.empty();
    plan.validate(num_layers(), fused ? RunKind::kFused : plan.bwd_plan.empty() ? RunKind::kInfer : RunKind::kTrain);
  }

  static void check_num_microbatch(int64_t m) {
    TORCH_CHECK_VALUE(m >= 1, "num_microbatch must be >= 1, got ", m);
  }

  ModelExecutePlan plan_for(const RunConfig& cfg, RunKind kind, int64_t num_microbatch) {
    ModelExecutePlan plan = cfg.execute_plan() ? *cfg.execute_plan() : automatic_plan(kind, num_microbatch);
    plan.validate(num_layers(), kind);
    return plan;
  }

  // The plan a call of `kind` with `num_microbatch` microbatches uses when
  // none is given (planner.h).
  ModelExecutePlan automatic_plan(RunKind kind, int64_t num_microbatch) {
    return planner.plan(kind, num_microbatch, layer_costs(), layers_timed());
  }

  // Per-layer costs for planning: the timer's estimates once every layer has
  // a forward time (recompute defaults to forward, backward to twice forward
  // until measured); before that, parameter bytes stand in for time.
  LayerCosts layer_costs() const {
    LayerCosts costs;
    costs.param_bytes = store->layer_param_bytes();
    const bool timed = layers_timed();
    for (int64_t l = 0; l < num_layers(); ++l) {
      const double size = static_cast<double>(costs.param_bytes[l]);
      const double fwd = timed ? *timer.estimate(l, LayerAction::kForward) : size;
      costs.fwd_ms.push_back(fwd);
      costs.recompute_ms.push_back(timed ? timer.estimate(l, LayerAction::kRecompute).value_or(fwd) : size);
      costs.bwd_ms.push_back(timed ? timer.estimate(l, LayerAction::kBackward).value_or(2 * fwd) : 2 * size);
    }
    return costs;
  }

  // This model's forward_backward calls return at their losses
  // (RoundPipeOptions::overlap_iterations). A call whose inputs require
  // grad still waits for its end.
  bool iterations_overlap() const { return overlap_iterations; }

  // Every layer has a forward time estimate.
  bool layers_timed() const {
    for (int64_t l = 0; l < num_layers(); ++l) {
      if (!timer.estimate(l, LayerAction::kForward).has_value()) return false;
    }
    return true;
  }

  int64_t microbatches_for(const RunConfig& cfg, const std::vector<c10::IValue>& args,
                           const Kwargs& kwargs) const {
    int64_t m = cfg.num_microbatch().value_or(num_devices + 1);
    check_num_microbatch(m);
    c10::optional<int64_t> batch =
        cfg.split_input() ? split_batch_size(args, kwargs, *cfg.split_input()) : find_batch_size(args, kwargs);
    if (batch && *batch < m) {
      TORCH_CHECK_VALUE(*batch >= 1, "the batch is empty (dim 0 of the first input tensor is 0)");
      TORCH_WARN("RoundPipe '", name, "': num_microbatch ", m, " is larger than the batch size ",
                 *batch, "; using ", *batch);
      m = *batch;
    }
    return m;
  }

  std::shared_ptr<Call> new_call(int64_t m, const RunConfig& cfg) {
    auto call = std::make_shared<Call>();
    call->model = ModelView{name, &layers, store.get(), seed, group ? group->rank() * m : 0,
                            param_gate.get(), param_gate->issued(), unwritten_buffers};
    call->num_microbatch = m;
    call->grain = cfg.recompute_grain().value_or(RecomputeGrain::kStage);
    call->preserve_rng = cfg.preserve_rng_state().value_or(true);
    call->trace = Tracer::instance().on();
    call->backward_starts.assign(layers.size(), 0);
    return call;
  }

  std::shared_ptr<ForwardRecord> new_record(int64_t m) {
    auto record = std::make_shared<ForwardRecord>();
    record->call_id = next_call_id++;
    record->autocast = AutocastState::of_this_thread();  // on the caller's thread
    record->num_microbatch = m;
    record->stage_inputs.assign(layers.size(), std::vector<Slot>(m));
    record->recompute_data.assign(layers.size(), {});
    for (auto& per_layer : record->recompute_data) per_layer.resize(m);
    return record;
  }

  // Splits the inputs and makes them the first job's input slots: layer 0
  // receives (args, kwargs) packed in one tuple.
  static void feed_inputs(Call& call, const MicrobatchInputs& inputs) {
    for (int64_t m = 0; m < call.num_microbatch; ++m) {
      c10::impl::GenericList args(c10::AnyType::get());
      for (const auto& a : inputs.args[m]) args.push_back(a);
      c10::impl::GenericDict kwargs(c10::StringType::get(), c10::AnyType::get());
      for (const auto& entry : inputs.kwargs[m]) kwargs.insert(entry.key(), entry.value());
      Slot& slot = call.flow[0][m];
      slot.value = c10::ivalue::Tuple::create({args, kwargs});
      slot.ready = true;
    }
    wait_for_callers_streams(call);
  }

  // Inputs and labels on an accelerator were made by work queued on the
  // caller's current stream, which the devices' lanes do not wait for: the
  // caller's thread waits for it here, before any job reads them.
  static void wait_for_callers_streams(const Call& call) {
    std::vector<c10::Device> waited;
    auto wait = [&](const c10::IValue& value) {
      for (const at::Tensor& t : flatten_tensors(value)) {
        if (!t.defined() || t.is_cpu() || !c10::impl::hasDeviceGuardImpl(t.device().type()) ||
            std::find(waited.begin(), waited.end(), t.device()) != waited.end()) {
          continue;
        }
        waited.push_back(t.device());
        c10::impl::getDeviceGuardImpl(t.device().type())->getStream(t.device()).synchronize();
      }
    };
    for (int64_t m = 0; m < call.num_microbatch; ++m) wait(call.flow[0][m].value);
    for (const c10::IValue& label : call.labels) wait(label);
  }

  // The call's own copy of its inputs, for a call that returns before its
  // backward stages have read them: the caller may reuse its tensors then.
  static void own_inputs(Call& call) {
    for (int64_t m = 0; m < call.num_microbatch; ++m) call.flow[0][m].value = clone_tensors(call.flow[0][m].value);
    wait_for_callers_streams(call);  // the copies of accelerator inputs
  }

  // Runs every job of `call` (its jobs and flow already set) on the devices
  // the scheduler gives them, and waits; rethrows the first error. A call
  // still in flight is finished first.
  void execute(const std::shared_ptr<Call>& call) {
    finish_in_flight();
    last_call_overlaps = false;
    submit(call);
    finish(*call);
  }

  // Hands `call`'s jobs to the devices the scheduler gives them.
  void submit(const std::shared_ptr<Call>& call) {
    record_calls_finished_by_steps();
    DevicePool& pool = DevicePool::instance();
    // Each job goes to the device on which it is predicted to start first,
    // from the timer's estimates (scheduler.h); the previous call's jobs
    // still run if it returned at its losses (iteration overlap). Until every
    // layer is timed, round-robin: the planner's stand-in for time
    // (parameter bytes) is in other units than the ledger's milliseconds,
    // which the pool's other models share.
    std::vector<double> job_ms;
    if (layers_timed()) job_ms = job_times_ms(call->jobs, layer_costs());
    dispatcher().assign(call->jobs, num_devices, job_ms, call->num_microbatch,
                        last_call_overlaps ? CallIssue::kAtLosses : CallIssue::kAtEnd);
    call->programs = make_lane_programs(call->jobs, call->num_microbatch);
    call->find_readers();
    std::vector<int64_t> devices;
    std::vector<std::function<void(Device&)>> tasks;
    for (size_t j = 0; j < call->jobs.size(); ++j) {
      devices.push_back(call->jobs[j].device);
      tasks.push_back([c = call.get(), j](Device& dev) { run_job(*c, j, dev); });  // call outlives its jobs
    }
    pool.submit_batch(devices, tasks);
  }

  // Waits for a submitted call, records its timings and trace; rethrows its
  // first error. (commit() applies it.)
  void finish(Call& call) {
    try {
      call.wait_all();
    } catch (...) {
      add_to_trace(call);
      throw;
    }
    record_layer_times(call, timer);
    add_to_trace(call);
  }

  // A call's failure raised by a later call: the later one's jobs stop and
  // it changes nothing; rethrows `error`.
  [[noreturn]] void cancel_and_rethrow(Call& call, std::exception_ptr error) {
    call.fail(std::make_exception_ptr(std::runtime_error("cancelled")), "");
    forget_buffers_of(call);
    try {
      call.wait_all();
    } catch (...) {
    }
    std::rethrow_exception(error);
  }

  // The forward_backward still running its backward stages (iteration
  // overlap), finished and applied; its error is raised here. No-op when
  // none is in flight (a step may have taken it).
  void finish_in_flight() {
    if (!in_flight) return;
    std::shared_ptr<Call> call = std::move(in_flight);
    in_flight.reset();
    try {
      finish(*call);
    } catch (...) {
      forget_buffers_of(*call);
      throw;
    }
    commit(*call);
  }

  // Nothing of this model runs any more: no call in flight, the optimizer
  // thread idle, every call it finished applied; then the first error of an
  // asynchronous step_fn, if any, is raised. What reads or replaces the
  // model's state starts here.
  void quiesce() {
    finish_in_flight();
    drain_optimizer();
    record_calls_finished_by_steps();
    rethrow_step_error();
  }

  // Timings and traces of the calls whose completion a step awaited on the
  // optimizer thread (the timer and the tracer belong to the user thread).
  void record_calls_finished_by_steps() {
    std::vector<std::shared_ptr<Call>> calls;
    {
      std::lock_guard<std::mutex> lock(optim_mu);
      calls.swap(finished_by_steps);
    }
    for (const auto& call : calls) {
      if (call->failed()) {
        forget_buffers_of(*call);
      } else {
        record_layer_times(*call, timer);
        commit_buffers(*call);
      }
      add_to_trace(*call);
    }
  }

  static void add_to_trace(const Call& call) {
    if (!call.trace) return;
    try {
      Tracer::instance().add(call_trace_events(call));
    } catch (const std::exception& e) {
      TORCH_WARN("RoundPipe: a call's events could not be added to the trace: ", e.what());
    }
  }

  // Applies a successful call: gradients into the fp32 accumulators (job
  // order, so the sum does not depend on devices), then forward buffers.
  void commit(const Call& call) {
    accumulate_gradients(call);
    commit_buffers(call);
  }

  void accumulate_gradients(const Call& call) {
    auto& params = store->params();
    for (const auto& job_grads : call.grads) {
      for (const auto& [id, grad] : job_grads) {
        at::Tensor& acc = params[id].grad;
        if (acc.defined()) {
          acc.add_(grad);
        } else {
          acc = grad.to(at::kFloat);
        }
      }
    }
  }

  // The host buffers <- what `call`'s forward left, unless a later call's
  // are there already (a call a step finished is applied after the calls
  // the user thread finished since).
  void commit_buffers(const Call& call) {
    const int64_t id = call.record ? call.record->call_id : -1;
    bool any = false;
    for (const auto& job_buffers : call.buffers) any = any || !job_buffers.empty();
    if (!any || id <= host_buffers_call) return;
    for (const auto& job_buffers : call.buffers) {
      for (const auto& [l, values] : job_buffers) {
        NamedTensors host = layers[l]->named_buffers();
        for (size_t i = 0; i < values.size(); ++i) {
          if (values[i].defined()) host[i].second.detach().copy_(values[i]);
        }
      }
    }
    host_buffers_call = id;
    if (unwritten_buffers && unwritten_buffers->call_id() <= id) unwritten_buffers.reset();
  }

  // The host buffers <- those of the latest call issued (user thread): a
  // call in flight is finished and applied (its failure raised), one a step
  // took is waited for (its failure is the step's to report). What reads
  // the host buffers (state_dict) starts here.
  void apply_unwritten_buffers() {
    if (!unwritten_buffers) return;
    if (in_flight && in_flight->buffer_out == unwritten_buffers) finish_in_flight();
    if (!unwritten_buffers) return;
    std::shared_ptr<Call> call = unwritten_call.lock();  // taken by a step
    if (!call) return;
    try {
      call->wait_all();
    } catch (...) {
    }
    if (call->failed()) {
      forget_buffers_of(*call);
    } else {
      commit_buffers(*call);
    }
  }

  // `call` failed: its buffers are never applied, and calls issued from now
  // on read the host buffers again.
  void forget_buffers_of(const Call& call) {
    if (unwritten_buffers && call.buffer_out == unwritten_buffers) unwritten_buffers.reset();
  }

  bool is_training() const { return layers.front()->is_training(); }

  // The device assignment shared by every model of the process.
  static Dispatcher& dispatcher();

  // ---- optimizer side (optimizer_side.cpp) ----
  void make_optimizer_copies(c10::optional<at::ScalarType> optim_dtype);
  // Rethrows (once) the first error of an asynchronous step_fn.
  void rethrow_step_error();
  // Waits until the optimizer thread has run everything queued so far.
  void drain_optimizer();
  // Optimizer copies <- model parameters (after the model's weights were loaded).
  void copy_model_to_optimizer();
  // Optimizer copies -> model parameters (cast to the model dtype), layer by
  // layer, marking each layer written for `generation` of param_gate.
  // With `reading` (a call in flight), layer l is written only once that
  // call no longer reads it, deepest layers first (the order they are
  // released in).
  void write_model_parameters(int64_t generation, Call* reading = nullptr);
  void step(StepFn step_fn, bool is_async);
  void synchronize();
  // Waits until the model's parameters hold what the latest step published
  // (its optimizer -> model write, not its step_fn), so reading them does
  // not race with that write. Returns at once on this model's optimizer
  // thread, where the write of a synchronous step comes after the step_fn.
  void wait_published() const {
    if (!optimizer_thread->on_this_thread()) param_gate->wait_all(param_gate->issued());
  }
  // wait_published(), and the host buffers those of the latest call.
  void wait_state_current() {
    if (optimizer_thread->on_this_thread()) return;
    apply_unwritten_buffers();
    wait_published();
  }

  // A forward_backward whose backward stages still run (iteration overlap;
  // user thread). A step takes it to the optimizer thread.
  std::shared_ptr<Call> in_flight;
  // The last call submitted returned at its losses (user thread): the
  // dispatcher then predicts the next call to start with its backward stages.
  bool last_call_overlaps = false;
  bool has_buffers = false;  // some layer has buffers
  // Buffers: the forward's of the latest call not applied yet (in flight,
  // or finished by a step and not recorded yet), which the next calls
  // upload instead of the host buffers; null when the host buffers are the
  // latest. host_buffers_call: the call whose buffers the host holds (-1:
  // none since construction or loading). User thread.
  std::shared_ptr<BufferHandoff> unwritten_buffers;
  std::weak_ptr<Call> unwritten_call;  // the call that makes unwritten_buffers
  int64_t host_buffers_call = -1;

  std::mutex optim_mu;
  std::vector<std::shared_ptr<Call>> finished_by_steps;  // guarded by optim_mu
  std::exception_ptr step_error;      // guarded by optim_mu: first error of a step_fn
  std::string step_error_context;     // guarded by optim_mu
  int64_t steps_issued = 0;           // user thread only
  bool model_behind_optimizer = false;  // user thread only: the last step was delayed

  std::string name;
  RunConfig defaults;
  torch::nn::Sequential seq{nullptr};
  std::vector<std::shared_ptr<Layer>> layers;
  ModelTimer timer;
  bool overlap_iterations = true;  // RoundPipeOptions::overlap_iterations
  int64_t sync_warmup_steps = 0;   // RoundPipeOptions::sync_warmup_steps
  int64_t num_devices = 1;
  Planner planner;  // after num_devices and overlap_iterations, which it is made from
  std::unique_ptr<HostStore> store;
  uint64_t seed = 0;
  int64_t next_call_id = 0;
  std::unique_ptr<ParamGate> param_gate;  // per-layer readiness of the parameters
  // Data parallelism: the processes' group (null: alone), used by the
  // optimizer thread after construction.
  std::shared_ptr<ProcessGroup> group;
  GradientReduction reduction = GradientReduction::kSum;
  std::unique_ptr<GroupAttachment> attachment;  // destroyed after the optimizer thread

  // Declared last: destroyed first, after running what is queued.
  std::unique_ptr<WorkerThread> optimizer_thread;

 public:
  ~Impl() {
    if (in_flight) {
      try {  // its jobs use the layers and the store: they end first
        in_flight->wait_all();
      } catch (...) {
      }
      add_to_trace(*in_flight);
    }
    // The calls steps finish belong in the trace too (a trace written at
    // exit shows every call).
    try {
      if (optimizer_thread) drain_optimizer();
    } catch (...) {
    }
    std::lock_guard<std::mutex> lock(optim_mu);
    for (const auto& call : finished_by_steps) add_to_trace(*call);
  }
};

}  // namespace roundpipe
