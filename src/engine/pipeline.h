// A model's pipeline: calls built from a plan, their jobs handed to the
// devices, and their results applied once they succeed. Every call ends
// here, through one path (docs/design/engine.md, "A call's life"):
//
//   make_call()   the jobs of a plan, the call's random keys and buffers
//   start()       submitted behind the call in flight (whose jobs its own
//                 queue behind); the call in flight finished and applied;
//                 returns at the new call's losses, which is then in flight
//   run()         submitted and waited for, for calls whose results the
//                 caller reads (forward, backward through autograd); the
//                 caller applies it with apply() once it has read them
//   hand_to_step()   a step takes the call in flight's gradients (which it
//                 sums once the call is done) and the order in which the call
//                 stops reading the parameters; the rest of the call stays here
//   finish_in_flight(), finish_handed_calls()   a call finished (timings,
//                 trace; its failure raised, or for a handed call left to the
//                 step to report) and applied: gradients into the model's
//                 GradientSums (job order), forward buffers into the host
//                 buffers
//
// A forward_backward stays in flight until whatever reads its effects needs
// them (the next call, step, synchronize, state_dict, checkpoints). Buffers
// a forward writes are ordered like parameters: a call issued while an
// earlier one is in flight uploads the buffers that call's forward left
// (BufferHandoff: its downloads of what it wrote, the host tensors it read
// for the rest), and the host buffers take them when that call is applied.
//
// What it needs, given at construction, outlives it: the model's layers and
// host store (which the jobs read), the parameter gate (which their uploads
// wait on), the timer (which finished calls record into and whose estimates
// place their jobs), the gradient sums (which applied calls add to), and the
// devices every model shares (the pool and its dispatcher).
//
// Thread-safety: the model's user thread only. The GradientsInFlight a step
// takes belongs to the optimizer thread.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "engine/buffer_handoff.h"
#include "engine/call.h"
#include "engine/gradient_sums.h"
#include "engine/gradients_in_flight.h"
#include "engine/layer_handle.h"
#include "engine/param_gate.h"
#include "engine/shared_devices.h"
#include "roundpipe/microbatch.h"
#include "roundpipe/run_config.h"
#include "roundpipe/timer.h"
#include "schedule/scheduler.h"

namespace roundpipe {

class HostStore;

class Pipeline {
 public:
  // Over what it needs (above), which outlives it. Its calls run on the
  // first `num_devices` devices of `devices`' pool. `rank`: the process's
  // in data parallelism (0 alone); its microbatch m draws random numbers as
  // microbatch rank * M + m of one process would.
  Pipeline(std::string name, std::vector<std::shared_ptr<LayerHandle>>& layers,
           const HostStore& store, const ParamGate& gate, ModelTimer& timer,
           GradientSums& gradients, SharedDevices& devices, int64_t num_devices, int64_t rank,
           uint64_t seed);
  // Waits for the call in flight: its jobs use the layers and the store.
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // A call of `kind` running `plan` over `num_microbatch` microbatches.
  // kForward: `saves_for_backward` when autograd will run its backward;
  // kBackward: `record` is its forward's (otherwise a new one is made).
  std::shared_ptr<Call> make_call(CallKind kind, const ModelExecutePlan& plan,
                                  int64_t num_microbatch, const RunConfig& cfg,
                                  bool saves_for_backward,
                                  std::shared_ptr<ForwardRecord> record = nullptr);
  // Splits the inputs into the first job's slots: layer 0 receives (args,
  // kwargs) packed in one tuple.
  static void feed_inputs(Call& call, const MicrobatchInputs& inputs);

  // Starts `call` as described above. `overlap`: the caller will not read
  // the call's input gradients, so the call keeps its own copy of its inputs
  // and leaves its buffers for the calls issued meanwhile. Raises the call
  // in flight's failure (the new call then changes nothing), or the new
  // call's own before its losses.
  void start(const std::shared_ptr<Call>& call, bool overlap);
  // The call in flight finished and applied; its failure raised. No-op when
  // none is in flight.
  void finish_in_flight();
  // The call in flight finished (its failure raised) and never applied.
  void discard_in_flight();
  // The call in flight cancelled and never applied (its caller failed after
  // its losses); rethrows `error`.
  [[noreturn]] void cancel_in_flight(std::exception_ptr error);
  // Runs `call` to its end (after the call in flight); rethrows its first
  // error. apply() applies it.
  void run(const std::shared_ptr<Call>& call);
  // A call run() finished: its gradients and buffers into the model.
  void apply(Call& call);

  // For a step: the call in flight's gradients (null when none is in
  // flight, or a step took them already); the call is handed until
  // finish_handed_calls() applies the rest of it.
  std::shared_ptr<GradientsInFlight> hand_to_step();
  // The handed calls whose steps are done with them finished and applied,
  // in the order they were issued (`wait`: every handed call, waiting for
  // it). Their failures are the steps' to report.
  void finish_handed_calls(bool wait);
  // The host buffers hold the latest call's (what reads them, state_dict,
  // starts here): the call whose forward wrote them last finished.
  void make_host_buffers_current();

  // Adds a finished call's spans to the timeline trace (when it traced).
  static void add_to_trace(const Call& call);

  // The random streams' seed and the next call's id, for checkpoints.
  struct State {
    uint64_t seed = 0;
    int64_t next_call_id = 0;
  };
  State state() const { return {seed_, next_call_id_}; }
  // After the host buffers were loaded: they are the latest.
  void load_state(const State& s);

 private:
  void submit(const std::shared_ptr<Call>& call, CallIssue issue);
  // Waits for a submitted call, records its timings and trace; rethrows its
  // first error.
  void finish(Call& call);
  void apply_buffers(const Call& call);
  // `call` failed: its buffers are never applied.
  void forget_buffers_of(const Call& call);
  static void wait_for_callers_streams(const Call& call);
  static void own_inputs(Call& call);

  const std::string name_;
  std::vector<std::shared_ptr<LayerHandle>>& layers_;
  const HostStore& store_;
  const ParamGate& gate_;
  ModelTimer& timer_;
  GradientSums& gradients_;
  SharedDevices& devices_;
  const int64_t num_devices_;
  const int64_t rank_;
  bool has_buffers_ = false;
  uint64_t seed_ = 0;
  int64_t next_call_id_ = 0;

  std::shared_ptr<Call> in_flight_;
  // Calls whose gradients steps took, not applied yet, in issue order.
  struct HandedCall {
    std::shared_ptr<Call> call;
    std::shared_ptr<const GradientsInFlight> gradients;  // done(): the step is done with the call
  };
  std::vector<HandedCall> handed_;
  // The last call submitted returned at its losses: the dispatcher predicts
  // the next call to start with its backward stages.
  bool last_call_overlaps_ = false;
  // The forward buffers of the latest call not applied yet (in flight, or
  // handed to a step), which the next calls upload
  // instead of the host buffers; null when the host buffers are the latest.
  std::shared_ptr<BufferHandoff> unwritten_buffers_;
  std::weak_ptr<Call> unwritten_call_;  // the call that makes unwritten_buffers_
  int64_t host_buffers_call_ =
      -1;  // the call whose buffers the host holds (-1: none since loading)
};

}  // namespace roundpipe
