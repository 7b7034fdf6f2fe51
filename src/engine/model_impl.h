// RoundPipe's engine: a thin façade over its parts, each of which owns its
// state (docs/design/engine.md, "The engine's parts"):
//   HostStore      the model's parameters in host memory (store)
//   Planner        layer costs, the timer, automatic and searched plans
//   GradientSums   the gradients the calls leave for the next step
//   OptimizerSide  optimizer copies, the optimizer thread, the parameter
//                  gate, step errors, data parallelism
//   Pipeline       calls: their jobs on the devices, the call in flight,
//                  buffers handed from call to call, applying results
// The façade sequences them: a step takes the pipeline's call in flight and
// the summed gradients to the optimizer side; quiesce() waits for all of it.
//
// Thread-safety: each public call holds `use` (model_use.h), so one call runs
// at a time; the parts' functions belong to that call's thread, except
// where a part says otherwise.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <string>
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

class RoundPipe::Impl : public std::enable_shared_from_this<RoundPipe::Impl> {
 public:
  // The only way to make one: its last owner may let go on any thread.
  static std::shared_ptr<Impl> create(std::vector<std::shared_ptr<LayerHandle>> layers,
                                      RoundPipeOptions options, torch::nn::Sequential seq);
  // Waits for the optimizer side's queued work (the call in flight is the
  // pipeline's to wait for, as it goes).
  ~Impl();

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }
  bool is_training() const { return layers.front()->is_training(); }

  // Nothing of this model runs any more: no call in flight, the optimizer
  // thread idle, every call it finished applied; then the first error of an
  // asynchronous step_fn, if any, is raised (unless not `raise_step_error`:
  // it stays for the next call). What reads or replaces the model's state
  // starts here.
  void quiesce(bool raise_step_error = true);
  // Before a call: the calls steps finished are recorded (timings, traces,
  // buffers), and with `raise_step_error` a step's error raised.
  void begin_call(bool raise_step_error = true);
  void step(StepFn step_fn, bool is_async);
  void synchronize();
  // The parameters hold the latest step's write and the host buffers the
  // latest call's (returns at once on the optimizer thread).
  void wait_state_current();

  // Everything a checkpoint holds besides the parameters, buffers and
  // optimizer copies themselves. Export and import after quiesce().
  struct State {
    Pipeline::State pipeline;
    OptimizerSide::State optimizer;
    std::vector<ModelTimer::Entry> timer;
    std::vector<at::Tensor> accumulated, master_grad,
        optim_grad;  // [parameter id], undefined where none
  };
  State export_state() const;
  void import_state(State state);

  const std::string name;
  const RunConfig defaults;
  torch::nn::Sequential seq{nullptr};
  std::vector<std::shared_ptr<LayerHandle>> layers;
  const int64_t num_devices;
  const bool overlap_iterations;  // RoundPipeOptions::overlap_iterations
  // Held by every public call that runs, waits for or changes the model.
  ModelUseLock use{name};
  // The parts, in the order they are made (and destroyed in reverse).
  std::unique_ptr<HostStore> store;
  Planner planner;
  GradientSums gradients;
  OptimizerSide optimizer;
  Pipeline pipeline;

 private:
  Impl(std::vector<std::shared_ptr<LayerHandle>> layers, RoundPipeOptions options,
       torch::nn::Sequential seq);
};

}  // namespace roundpipe
