// RoundPipe's engine: a façade over its parts, each of which owns its state
// (docs/design/engine.md, "The engine's parts"):
//   HostStore      the model's parameters in host memory (store)
//   Planner        layer costs, the timer, automatic and searched plans
//   GradientSums   the gradients the calls leave for the next step
//   OptimizerSide  optimizer copies, the optimizer thread, the parameter
//                  gate, step errors, data parallelism
//   Pipeline       calls: their jobs on the devices, the call in flight,
//                  buffers handed from call to call, applying results
// Each public function of RoundPipe is one function here, which orders the
// parts; the parts are private. The calls live in model_calls.cpp, the
// steps and state in model_state.cpp, making the parts in model_impl.cpp.
//
// Thread-safety: each public function that runs, waits for or changes the
// model holds its use (model_use.h), so one runs at a time; the parts'
// functions belong to that call's thread, except where a part says
// otherwise.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/gradient_sums.h"
#include "engine/host_store.h"
#include "engine/layer_handle.h"
#include "engine/model_use.h"
#include "engine/optimizer_side.h"
#include "engine/pipeline.h"
#include "engine/planner.h"
#include "roundpipe/model.h"
#include "roundpipe/timer.h"

namespace roundpipe {

struct ForwardRecord;

class RoundPipe::Impl : public std::enable_shared_from_this<RoundPipe::Impl> {
 public:
  // The only way to make one: its last owner may let go on any thread.
  static std::shared_ptr<Impl> create(std::vector<std::shared_ptr<LayerHandle>> layers,
                                      RoundPipeOptions options, torch::nn::Sequential seq);
  // Waits for the optimizer side's queued work (the calls are the
  // pipeline's to wait for, as it goes).
  ~Impl();

  const std::string& name() const { return name_; }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t num_devices() const { return num_devices_; }
  bool is_training() const { return layers_.front()->is_training(); }
  void train(bool on);
  // The Sequential it was built from (checked: not built from layers).
  torch::nn::Sequential& sequential();

  // Calls (model_calls.cpp), as RoundPipe's.
  c10::IValue forward(std::vector<c10::IValue> args, Kwargs kwargs, const RunConfig& run_config);
  c10::IValue forward_backward(std::vector<c10::IValue> args, Kwargs kwargs, c10::IValue label,
                               const LossFn& loss_fn, bool return_outputs,
                               const RunConfig& run_config);
  // The backward stages of a forward() that autograd differentiates:
  // `output_grads` [M] per microbatch's output tensors; returns the input
  // gradients [M] in host memory.
  std::vector<c10::IValue> backward(const std::shared_ptr<ForwardRecord>& record,
                                    const ModelExecutePlan& plan, const RunConfig& cfg,
                                    std::vector<c10::IValue> output_grads);

  // Steps and state (model_state.cpp), as RoundPipe's.
  void step(StepFn step_fn, bool is_async);
  void synchronize();
  std::vector<std::pair<std::string, at::Tensor>> optim_named_parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> state_dict();
  void load_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& state, bool strict);
  void refresh_optimizer_copies();

  // Plans and timings, as RoundPipe's.
  ModelExecutePlan default_execute_plan(RunKind kind);
  const ModelTimer& timer() const { return planner_.timer(); }
  ModelTimer& timer() { return planner_.timer(); }
  LayerCosts layer_costs() const { return planner_.layer_costs(); }

  // For checkpoints (checkpoint.cpp). Held by every public call that runs,
  // waits for or changes the model.
  ModelUseLock& use() { return use_; }
  // Nothing of this model runs any more: no call in flight, the optimizer
  // thread idle, every call applied; then the first error of an
  // asynchronous step_fn, if any, is raised (unless not `raise_step_error`:
  // it stays for the next call). What reads or replaces the model's state
  // starts here.
  void quiesce(bool raise_step_error = true);
  // Every unique parameter, with its optimizer copy (read only).
  const std::vector<HostParam>& params() const { return store_->params(); }
  // Every layer's parameters and buffers by model-wide name ("<layer>.<name>").
  std::vector<std::pair<std::string, at::Tensor>> named_state() const;
  ProcessGroup* process_group() const { return optimizer_.group(); }

  // Everything a checkpoint holds besides the parameters, buffers and
  // optimizer copies themselves. Export after quiesce(); import after
  // quiesce() and after the parameters were written from the checkpoint.
  struct State {
    Pipeline::State pipeline;
    OptimizerSide::State optimizer;
    std::vector<ModelTimer::Entry> timer;
    std::vector<at::Tensor> accumulated, master_grad,
        optim_grad;  // [parameter id], undefined where none
  };
  State export_state() const;
  void import_state(State state);

 private:
  Impl(std::vector<std::shared_ptr<LayerHandle>> layers, RoundPipeOptions options,
       torch::nn::Sequential seq);

  // Before a call: the calls steps are done with are applied, and with
  // `raise_step_error` a step's error raised.
  void begin_call(bool raise_step_error = true);
  // The parameters hold the latest step's write and the host buffers the
  // latest call's (returns at once on the optimizer thread).
  void wait_state_current();
  // The number of microbatches, the plan, inputs and labels of a call,
  // checked and split (model_calls.cpp).
  struct PreparedCall;
  PreparedCall prepare_call(const char* what, RunKind kind, const RunConfig& cfg,
                            const std::vector<c10::IValue>& args, const Kwargs& kwargs,
                            const c10::IValue* label);

  const std::string name_;
  const RunConfig defaults_;
  torch::nn::Sequential seq_{nullptr};
  std::vector<std::shared_ptr<LayerHandle>> layers_;
  const int64_t num_devices_;
  const bool overlap_iterations_;  // RoundPipeOptions::overlap_iterations
  ModelUseLock use_{name_};
  // The parts, in the order they are made (and destroyed in reverse).
  std::unique_ptr<HostStore> store_;
  Planner planner_;
  GradientSums gradients_;
  OptimizerSide optimizer_;
  Pipeline pipeline_;
};

}  // namespace roundpipe
