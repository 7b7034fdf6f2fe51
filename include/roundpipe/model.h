// RoundPipe: a host-resident model run as a pipeline over the device pool.
//
// The model's parameters and buffers stay on the host and remain the master
// copy (the wrapped Sequential's own tensors). Calls split the batch into
// microbatches, run stages of consecutive layers as jobs on the devices in
// round-robin order, and merge the results.
//
// Thread-safe: calls from several threads are serialized (a lock per model;
// one call at a time, whichever thread takes it first). A call made from
// inside the model's own user code (a step_fn on the optimizer thread, a
// loss_fn or a layer on a device thread) throws c10::Error at once, naming
// the call and that code: it would wait for the thread it runs on. Several
// instances may share the devices.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <roundpipe/auto_plan.h>
#include <roundpipe/devices.h>
#include <roundpipe/distributed.h>
#include <roundpipe/layer.h>
#include <roundpipe/microbatch.h>
#include <roundpipe/optimizer.h>
#include <roundpipe/plan.h>
#include <roundpipe/run_config.h>
#include <roundpipe/timer.h>

namespace roundpipe {

namespace detail {
struct EngineAccess;
}  // namespace detail

// loss_fn(outputs of one microbatch, label of that microbatch) -> a scalar
// tensor or a list/tuple of scalar tensors. Runs on the device next to the
// outputs.
using LossFn = std::function<c10::IValue(const c10::IValue& outputs, const c10::IValue& label)>;

// Model-level options, fixed at construction.
// How the host copy of the parameters is kept (where devices upload from).
enum class PinMode {
  // Packed into one exact-size arena per layer, all arenas one slab in layer
  // order (the model's parameters then view it; a stage uploads in one
  // copy), page-locked when the devices are CUDA devices. The default.
  kAlloc,
  // Left where they are and page-locked in place when the devices are CUDA
  // devices (cudaHostRegister); nothing is copied.
  kRegister,
  // Left where they are, not page-locked: weights memory-mapped from a file
  // stay mapped (no host copy), for models larger than RAM.
  kOff,
};

// "alloc", "register", "off" (the names Python's `pin_model=` takes).
const char* pin_mode_name(PinMode mode);
// The mode named `name`; c10::ValueError listing the names otherwise.
PinMode pin_mode_from_name(const std::string& name);

struct RoundPipeOptions {
  // Shown in errors, logs and traces. Default: "roundpipe".
  std::string name = "roundpipe";
  // Defaults for every call (see RunConfig).
  RunConfig run_config;
  // Use only the first N devices of the pool (0: all).
  int64_t max_devices = 0;
  // Dtype of the optimizer copies (one per trainable parameter, always a
  // separate tensor). Default: the parameters' own dtype. E.g. bf16 model
  // parameters with kFloat optimizer copies. With kBFloat16 copies (the
  // compact configuration, with roundpipe::optim::AdamW's 8-bit states) the
  // gradients are kept in bf16 too: one gradient per parameter, summed over
  // calls with stochastic rounding (docs/design/engine.md, "Host memory");
  // other dtypes sum gradients in fp32.
  c10::optional<at::ScalarType> optim_dtype;
  // Seed of the model's random streams (dropout and other draws): streams
  // depend on (seed, call, layer, microbatch) only. Default: drawn from the
  // global generator at construction, so torch::manual_seed() fixes it.
  c10::optional<uint64_t> seed;
  // Data parallelism (distributed.h): train together with the other
  // processes of this group, each on its share of the batch. Construction
  // then copies rank 0's parameters, buffers and seed to this process.
  // Default: none (this process trains alone).
  std::shared_ptr<ProcessGroup> process_group;
  // How step() combines the processes' gradients (with a process_group).
  GradientReduction gradient_reduction = GradientReduction::kSum;
  // Where the host parameters live and whether they are page-locked.
  PinMode pin_model = PinMode::kAlloc;
  // forward_backward returns at its losses while its backward stages still
  // run, and the next call's jobs queue behind them (docs/guide.md, "3. A
  // training loop"); results are
  // bitwise those of the non-overlapped order. false: every call returns
  // when it has ended. Default: true.
  bool overlap_iterations = true;
  // The first n asynchronous steps run synchronously, then the one-step
  // delay starts (step() below). Default: the process-wide
  // set_sync_warmup_steps (deprecated), 0 unless set.
  c10::optional<int64_t> sync_warmup_steps;

  RoundPipeOptions& set_name(std::string v) { name = std::move(v); return *this; }
  RoundPipeOptions& set_run_config(RunConfig v) { run_config = std::move(v); return *this; }
  RoundPipeOptions& set_max_devices(int64_t v) { max_devices = v; return *this; }
  RoundPipeOptions& set_seed(uint64_t v) { seed = v; return *this; }
  RoundPipeOptions& set_optim_dtype(at::ScalarType v) { optim_dtype = v; return *this; }
  RoundPipeOptions& set_process_group(std::shared_ptr<ProcessGroup> v) { process_group = std::move(v); return *this; }
  RoundPipeOptions& set_gradient_reduction(GradientReduction v) { gradient_reduction = v; return *this; }
  RoundPipeOptions& set_pin_model(PinMode v) { pin_model = v; return *this; }
  RoundPipeOptions& set_overlap_iterations(bool v) { overlap_iterations = v; return *this; }
  RoundPipeOptions& set_sync_warmup_steps(int64_t v) { sync_warmup_steps = v; return *this; }
};

class RoundPipe {
 public:
  // Wraps `model`: each child is a layer. Parameters and buffers must be on
  // the CPU and all layers cloneable (see layer.h). With PinMode::kAlloc
  // (the default) parameters are moved into one contiguous host arena per
  // layer, in one slab; the model's tensors keep their identity and now view
  // it.
  explicit RoundPipe(torch::nn::Sequential model, RoundPipeOptions options = {});
  // Errors in the options or the layers (c10::ValueError / c10::TypeError)
  // name the model and the constructor.
  ~RoundPipe();
  RoundPipe(RoundPipe&&) noexcept;
  RoundPipe& operator=(RoundPipe&&) noexcept;

  // Runs the model on a batch. Outputs are merged and returned on the CPU
  // (RunConfig::output_device). If requires_grad (default: grad mode on), the
  // floating-point output tensors carry autograd history: backward through them
  // runs the backward stages through the pipeline and accumulates parameter
  // gradients as forward_backward does. Errors in the arguments (run config,
  // plan, splitting the inputs, merging the outputs) are c10::ValueErrors
  // naming the model and the call; a call that fails changes no buffer.
  c10::IValue forward(std::vector<c10::IValue> args, Kwargs kwargs = make_kwargs(),
                      const RunConfig& run_config = RunConfig());
  // Convenience for a model whose first layer takes one tensor.
  at::Tensor forward(const at::Tensor& input, const RunConfig& run_config = RunConfig());

  // Exactly:
  //   for args_m, kwargs_m, label_m in split(args, kwargs, label):
  //     out_m = model(args_m, kwargs_m); loss_m = loss_fn(out_m, label_m)
  //     backward(loss_m)
  //   return sum of loss_m [, merge(out_m)]
  // Returns the summed loss (CPU, detached; a list of sums if loss_fn returns
  // a list), or the tuple (loss, outputs) when return_outputs. Parameter
  // gradients accumulate on the host in fp32 (microbatch order, then call
  // order); input tensors that require grad get their .grad. On failure the
  // error names model, stage, layer, microbatch and device (for errors in
  // the arguments, as forward: the model and the call), and no gradient,
  // buffer or input .grad is changed. loss_fn must return scalar tensors
  // computed from the outputs: c10::TypeError for anything but a tensor or a
  // list/tuple of tensors, c10::ValueError for a non-scalar tensor or one
  // that does not require grad.
  c10::IValue forward_backward(std::vector<c10::IValue> input_args, Kwargs input_kwargs,
                               c10::IValue label, const LossFn& loss_fn,
                               bool return_outputs = false,
                               const RunConfig& run_config = RunConfig());

  // Queues, on the optimizer thread and in order: adding the gradients of
  // every call issued so far to the optimizer copies' .grad (in optim dtype),
  // then step_fn. Let θ_k be the optimizer copies after the k-th step_fn.
  //  - is_async=false: returns when step_fn finished and the model's
  //    parameters equal θ_k; later calls see θ_k (plain synchronous training).
  //  - is_async=true: returns at once; later calls see θ_{k-1} (the one-step
  //    delay), so step_fn's cost hides under the next iteration.
  // At most one step is in flight: step waits for the previous step_fn first.
  // An exception from an asynchronous step_fn is rethrown (once, with the
  // model's name and step number) by the next step or synchronize, or by a
  // forward / forward_backward that starts after it was raised; the model is
  // usable again afterwards.
  void step(StepFn step_fn, bool is_async = true);

  // Waits for all queued work. Afterwards the model's parameters hold the
  // latest optimizer result (cast to the model dtype) and each parameter's
  // .grad holds the gradients accumulated since the last step that were not
  // handed to an optimizer (they stay pending: a later step hands .grad over,
  // and zeroing .grad drops them). Host memory the steps freed (gradients,
  // transfer buffers) is given back to the system here, so the resident set
  // is the training state (docs/design/engine.md, "Host memory").
  void synchronize();

  // The optimizer copies: one per trainable parameter, tied parameters once,
  // in model order ("<layer>.<name>").
  std::vector<at::Tensor> optim_parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> optim_named_parameters() const;
  // The model's parameters; the optimizer copies inside an OptimizerCtx or a
  // step_fn (see optimizer.h). The model's parameters are returned once they
  // hold what the latest step published (θ_{k-1} after an asynchronous step,
  // θ_k after a synchronous one): an asynchronous step's write is waited for,
  // its step_fn is not.
  std::vector<at::Tensor> parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;

  // Parameters and buffers by name ("<layer>.<name>"), master copies, once
  // they hold what the latest step published (as parameters()).
  std::vector<std::pair<std::string, at::Tensor>> state_dict() const;
  // Copies values into the parameters and buffers and refreshes the
  // optimizer copies, so loading after creating an optimizer is not undone by
  // the next step. Waits for queued work first. With `strict`, missing or
  // unexpected names are a c10::ValueError; a shape mismatch, a name given
  // twice, an undefined tensor or one without data (meta) always are one,
  // and complex values for a real tensor a c10::TypeError. Everything is
  // checked before anything is copied: a failed load changes nothing.
  void load_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& state, bool strict = true);

  // Copies the model's parameters into the optimizer copies (after waiting
  // for queued work). A step does this itself for every parameter changed in
  // place since the engine last wrote it (its version counter moved: a load
  // into the wrapped model, an in-place op), so that the step does not undo
  // the change; call it after changes no version counter sees (writes
  // through .data, a raw pointer or a memory mapping).
  void refresh_optimizer_copies();

  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const;

  int64_t num_layers() const;
  const std::string& name() const;
  // Number of devices this model's jobs are spread over.
  int64_t num_devices() const;
  // The plan a call of `kind` uses when its RunConfig has none: the automatic
  // plan (auto_plan.h) over layer_costs(), at least one stage per device,
  // upper_threshold 1.1, no memory limit. It is kept from call to call until
  // a new plan is predicted at least 20% faster (choose_plan), so timing
  // noise does not make it oscillate. Fused calls whose iterations overlap
  // on two devices or more, once every layer is timed, take the plan a
  // search simulating the pipeline finds from it; calls never wait for that
  // search (it runs on a background thread and is adopted when done), this
  // query does.
  ModelExecutePlan default_execute_plan(RunKind kind) const;
  // Per-layer time estimates (ModelTimer), updated after every call.
  const ModelTimer& timer() const;
  ModelTimer& timer();
  // What the planner sees: the timer's estimates in milliseconds once every
  // layer has a forward time (recompute then defaults to forward, backward
  // to twice forward, until measured); before that, parameter bytes stand in
  // for time (fwd = recompute = bytes, bwd = 2 * bytes).
  LayerCosts layer_costs() const;
  // The wrapped model (the Sequential given at construction, if any).
  torch::nn::Sequential& model();

  class Impl;

 private:
  // The engine's own files: checkpoints and the language bindings.
  friend struct detail::EngineAccess;
  explicit RoundPipe(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

// ModelExecutePlan.auto (docs/trace.md, "Computing a plan yourself"): plans for `models`, which run
// one after another over the same devices (chained), planned jointly from their layer_costs() with
// auto_plan (see auto_plan.h for how). options.min_stages 0 means the first model's num_devices().
// One plan per model, in order. Throws c10::ValueError as auto_plan does, or when `models` is empty
// or holds a null.
std::vector<ModelExecutePlan> auto_execute_plans(const std::vector<const RoundPipe*>& models,
                                                 AutoPlanOptions options);

// Writes the models' per-layer costs (layer_costs()) as a timings file for
// roundpipe-sim, atomically:
//   {"format": "roundpipe-timings-1", "models": [{"name": ..., "timed": true|false,
//    "layers": [{"fwd_ms", "recompute_ms", "bwd_ms", "param_bytes"}, ...]}, ...]}
// ("timed": false when the costs are still parameter-size estimates).
// Throws c10::Error when the file cannot be written.
void save_timings(const std::string& path, const std::vector<const RoundPipe*>& models);

}  // namespace roundpipe
