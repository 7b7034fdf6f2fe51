// RoundPipe's state, shared by the calls (roundpipe.cpp) and the optimizer
// side (optimizer_side.cpp).
//
// Thread-safety: owned by the model's user thread, except the optimizer
// members, which the optimizer thread uses as documented below.
#pragma once

#include <ATen/ATen.h>
#include <malloc.h>
#include <torch/nn/modules/container/sequential.h>

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/call.h"
#include "engine/host_store.h"
#include "engine/layer.h"
#include "engine/param_gate.h"
#include "engine/rng.h"
#include "roundpipe/model.h"
#include "runtime/device_pool.h"
#include "util/worker_thread.h"

namespace roundpipe {

class RoundPipe::Impl : public std::enable_shared_from_this<RoundPipe::Impl> {
 public:
  Impl(std::vector<std::shared_ptr<Layer>> layers_in, RoundPipeOptions options,
       torch::nn::Sequential seq_in)
      : name(std::move(options.name)),
        defaults(std::move(options.run_config)),
        seq(std::move(seq_in)),
        layers(std::move(layers_in)) {
    TORCH_CHECK_VALUE(!layers.empty(), "RoundPipe: the model has no layers");
    DevicePool& pool = DevicePool::instance();
    TORCH_CHECK_VALUE(options.max_devices >= 0 && options.max_devices <= pool.size(),
                      "RoundPipe: max_devices must be in 0..", pool.size(),
                      " (0 = all devices of the pool), got ", options.max_devices);
    num_devices = options.max_devices == 0 ? pool.size() : options.max_devices;
    if (options.seed) {
      seed = *options.seed;
    } else {
      std::lock_guard<std::mutex> lock(cpu_generator_lock());  // devices may be mid keyed run
      seed = static_cast<uint64_t>(at::empty({}, at::kLong).random_().item<int64_t>());
    }
    const bool pinned = !pool.device(0).torch_device().is_cpu();
    store = std::make_unique<HostStore>(layers, pinned);
    for (size_t i = 0; i < layers.size(); ++i) random_use.push_back(std::make_unique<RandomUse>());
    if (defaults.num_microbatch()) check_num_microbatch(*defaults.num_microbatch());
    if (defaults.execute_plan()) defaults.execute_plan()->validate(num_layers(), RunKind::kInfer);
    param_gate = std::make_unique<ParamGate>(num_layers());
    make_optimizer_copies(options.optim_dtype);
    // Packing into arenas and cloning replicas freed about the model's size
    // of heap memory: give it back to the system rather than keep it resident.
    malloc_trim(0);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  static void check_num_microbatch(int64_t m) {
    TORCH_CHECK_VALUE(m >= 1, "num_microbatch must be >= 1, got ", m);
  }

  ModelExecutePlan plan_for(const RunConfig& cfg, RunKind kind) const {
    ModelExecutePlan plan = cfg.execute_plan() ? *cfg.execute_plan()
                                               : default_plan(store->layer_param_bytes(), num_devices, kind);
    plan.validate(num_layers(), kind);
    return plan;
  }

  int64_t microbatches_for(const RunConfig& cfg, const std::vector<c10::IValue>& args,
                           const Kwargs& kwargs) const {
    int64_t m = cfg.num_microbatch().value_or(num_devices + 1);
    check_num_microbatch(m);
    const bool split_by_function = cfg.split_input() && cfg.split_input()->fn;
    c10::optional<int64_t> batch = find_batch_size(args, kwargs);
    if (!split_by_function && batch && *batch < m) {
      TORCH_CHECK_VALUE(*batch >= 1, "RoundPipe '", name, "': the batch is empty (dim 0 is 0)");
      TORCH_WARN("RoundPipe '", name, "': num_microbatch ", m, " is larger than the batch size ",
                 *batch, "; using ", *batch);
      m = *batch;
    }
    return m;
  }

  std::shared_ptr<Call> new_call(int64_t m, const RunConfig& cfg) {
    auto call = std::make_shared<Call>();
    call->model = ModelView{name, &layers, store.get(), &random_use, seed, is_training(), param_gate.get(),
                            param_gate->issued()};
    call->num_microbatch = m;
    call->grain = cfg.recompute_grain().value_or(RecomputeGrain::kStage);
    call->preserve_rng = cfg.preserve_rng_state().value_or(true);
    call->backward_starts.assign(layers.size(), 0);
    return call;
  }

  std::shared_ptr<ForwardRecord> new_record(int64_t m) {
    auto record = std::make_shared<ForwardRecord>();
    record->call_id = next_call_id++;
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
  }

  void add_jobs(Call& call, const std::vector<LayerRange>& ranges, JobKind kind, JobKind first_kind) {
    for (size_t s = 0; s < ranges.size(); ++s) {
      call.jobs.push_back(JobSpec{s == 0 ? first_kind : kind, ranges[s], static_cast<int64_t>(s), 0});
    }
  }

  // Runs every job of `call` (its flow already fed) and waits; rethrows the
  // first error.
  void execute(const std::shared_ptr<Call>& call) {
    DevicePool& pool = DevicePool::instance();
    std::vector<int64_t> devices = pool.assign_devices(call->jobs.size(), num_devices);
    for (size_t j = 0; j < call->jobs.size(); ++j) call->jobs[j].device = devices[j];
    std::vector<std::function<void(Device&)>> tasks;
    for (size_t j = 0; j < call->jobs.size(); ++j) {
      tasks.push_back([call, j](Device& dev) { run_job(call, j, dev); });
    }
    pool.submit_batch(devices, tasks);
    call->wait_all();
  }

  // Applies a successful call: gradients into the fp32 accumulators (job
  // order, so the sum does not depend on devices), then forward buffers.
  void commit(const Call& call) {
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
    for (const auto& job_buffers : call.buffers) {
      for (const auto& [l, values] : job_buffers) {
        NamedTensors host = layers[l]->named_buffers();
        for (size_t i = 0; i < values.size(); ++i) {
          if (values[i].defined()) host[i].second.detach().copy_(values[i]);
        }
      }
    }
  }

  bool is_training() const { return layers.front()->is_training(); }

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
  void write_model_parameters(int64_t generation);
  void step(StepFn step_fn, bool is_async);
  void synchronize();

  std::mutex optim_mu;
  std::exception_ptr step_error;      // guarded by optim_mu: first error of a step_fn
  std::string step_error_context;     // guarded by optim_mu
  int64_t steps_issued = 0;           // user thread only
  bool model_behind_optimizer = false;  // user thread only: the last step was delayed

  std::string name;
  RunConfig defaults;
  torch::nn::Sequential seq{nullptr};
  std::vector<std::shared_ptr<Layer>> layers;
  std::unique_ptr<HostStore> store;
  std::vector<std::unique_ptr<RandomUse>> random_use;  // [layer]
  int64_t num_devices = 1;
  uint64_t seed = 0;
  int64_t next_call_id = 0;
  std::unique_ptr<ParamGate> param_gate;  // per-layer readiness of the parameters

  // Declared last: destroyed first, after running what is queued.
  std::unique_ptr<WorkerThread> optimizer_thread;
};

}  // namespace roundpipe
