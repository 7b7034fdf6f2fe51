// A model's optimizer side: the optimizer copies of its parameters, the
// optimizer thread that runs step_fn (exactly one step behind the devices
// when asynchronous), the write of the copies back into the model behind
// the parameter gate, the first error of an asynchronous step, and the
// processes' gradient reduction (data parallelism).
//
// One step, top to bottom (docs/design/engine.md):
//   user thread: begin_step() drains the previous step and raises its error;
//     step() takes the gradients summed so far and those of the call still
//     in flight (GradientsInFlight), opens a write of the parameter gate,
//     and queues the step task;
//   optimizer thread: (delayed) the copies -> the model, layer by layer, as
//     the call in flight stops reading each layer; the call done; its
//     gradients and the taken ones summed, reduced across processes, handed
//     to the copies' .grad; step_fn; (synchronous) the copies -> the model.
//
// Thread-safety: the public functions belong to the model's user thread,
// except post() and on_this_thread() (any thread). The step task runs on the
// optimizer thread; what it shares with the user thread (the step error) is
// guarded by mu_, the parameters by the gate.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/data_parallel.h"
#include "engine/gradient_sums.h"
#include "engine/gradients_in_flight.h"
#include "engine/param_gate.h"
#include "roundpipe/distributed.h"
#include "roundpipe/model.h"
#include "util/worker_thread.h"

namespace roundpipe {

class HostStore;

class OptimizerSide {
 public:
  // `name`: the model's, for errors; `store`: its parameters (outlives this);
  // `sync_warmup_steps` >= 0 (RoundPipe::Impl checks its options).
  OptimizerSide(std::string name, HostStore& store, int64_t num_layers, int64_t sync_warmup_steps,
                std::shared_ptr<ProcessGroup> group, GradientReduction reduction);
  // Runs what is queued, then ends the thread.
  ~OptimizerSide();

  // The copies, in `optim_dtype` (default: each parameter's own).
  void make_copies(c10::optional<at::ScalarType> optim_dtype);
  // Optimizer copies <- model parameters (after the model's weights were loaded).
  void copy_model_to_optimizer();
  // The engine wrote the model's parameters by other means (a checkpoint):
  // what they hold now is the engine's, not a change from outside.
  void note_model_versions();

  // Before a step: the previous one done, its error raised. Returns whether
  // the step about to be issued with `is_async` is delayed one step.
  bool begin_step(bool is_async);
  // Issues a step (after begin_step): `gradients` summed so far, then those
  // of `in_flight`, the call still running (may be null), then
  // `model_grads` (what synchronize() left in .grad). A synchronous step
  // returns once the model holds its result.
  void step(StepFn step_fn, bool delayed, GradientSums gradients, GradientSums model_grads,
            std::shared_ptr<GradientsInFlight> in_flight);
  // After a quiesce: the model brought to the latest step's result (after a
  // delayed step it holds the one before).
  void catch_up_model();

  // Waits until the optimizer thread has run everything queued so far.
  void drain();
  // Rethrows (once) the first error of an asynchronous step_fn.
  void rethrow_step_error();

  // The parameter gate: calls wait on it layer by layer.
  const ParamGate& gate() const { return *gate_; }
  // Waits until the model's parameters hold what the latest step published
  // (its write, not its step_fn). Returns at once on the optimizer thread.
  void wait_published() const;

  // Queues `fn` behind the steps (run_on_optimizer_thread).
  void post(std::function<void()> fn) { thread_->post(std::move(fn)); }
  bool on_this_thread() const { return thread_->on_this_thread(); }

  ProcessGroup* group() const { return group_.get(); }

  // Checkpoints: the step counter and whether the model is one step behind.
  struct State {
    int64_t steps_issued = 0;
    bool model_behind = false;
  };
  State state() const { return {steps_issued_, model_behind_}; }
  void load_state(const State& s) {
    steps_issued_ = s.steps_issued;
    model_behind_ = s.model_behind;
  }
  // The model was written from outside (load_state_dict): it is current.
  void model_written() { model_behind_ = false; }

 private:
  void write_model_parameters(int64_t generation, const GradientsInFlight* reading = nullptr);
  // model parameter -> optimizer copy for every parameter changed in place
  // from outside since the engine last wrote it (its version counter moved:
  // a load_state_dict into the wrapped model, an in-place op), so the next
  // step does not undo the change. User thread, with the optimizer thread
  // idle.
  void take_changed_parameters();
  void note_version(int64_t id) { model_versions_[id] = store_.params()[id].master._version(); }
  // The task a step queues, on the optimizer thread.
  // `catch_up`: write the copies into the model before step_fn (a
  // synchronous step after a delayed one).
  void run_step(const StepFn& step_fn, bool delayed, bool catch_up, GradientSums& gradients,
                const GradientSums& model_grads, GradientsInFlight* call, int64_t generation,
                int64_t k, bool trace);
  void record_error(std::exception_ptr error, const std::string& context);

  const std::string name_;
  HostStore& store_;
  const int64_t num_layers_;
  const int64_t sync_warmup_steps_;
  std::unique_ptr<ParamGate> gate_;
  const std::shared_ptr<ProcessGroup> group_;  // null: alone
  const GradientReduction reduction_;
  int64_t steps_issued_ = 0;   // user thread
  bool model_behind_ = false;  // user thread: the last step was delayed
  // [parameter id] the master's version counter when the engine last wrote
  // it or took it into the copy: the user thread's, and the optimizer
  // thread's while a step it queued runs.
  std::vector<int64_t> model_versions_;

  std::mutex mu_;
  std::exception_ptr step_error_;   // guarded by mu_: first error of a step_fn
  std::string step_error_context_;  // guarded by mu_

  std::unique_ptr<GroupAttachment> attachment_;  // destroyed after the thread
  // Declared last: destroyed first, after running what is queued.
  std::unique_ptr<WorkerThread> thread_;
};

}  // namespace roundpipe
