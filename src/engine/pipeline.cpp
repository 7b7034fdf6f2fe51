// A model's pipeline (pipeline.h).
#include "engine/pipeline.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <optional>

#include "engine/call_timing.h"
#include "engine/host_store.h"
#include "engine/job_runner.h"
#include "engine/planner.h"
#include "engine/trace_recorder.h"
#include "schedule/lane_program.h"
#include "util/value_tree.h"

namespace roundpipe {

Pipeline::Pipeline(std::string name, std::vector<std::shared_ptr<LayerHandle>>& layers,
                   const HostStore& store, const ParamGate& gate, ModelTimer& timer,
                   GradientSums& gradients, SharedDevices& devices, int64_t num_devices,
                   int64_t rank, uint64_t seed)
    : name_(std::move(name)),
      layers_(layers),
      store_(store),
      gate_(gate),
      timer_(timer),
      gradients_(gradients),
      devices_(devices),
      num_devices_(num_devices),
      rank_(rank),
      seed_(seed) {
  for (const auto& l : layers_) has_buffers_ = has_buffers_ || !l->named_buffers().empty();
}

Pipeline::~Pipeline() {
  std::vector<std::shared_ptr<Call>> running;
  for (const HandedCall& h : handed_) running.push_back(h.call);
  if (in_flight_) running.push_back(in_flight_);
  for (const auto& call : running) {
    try {
      call->wait_all();
    } catch (...) {
    }
    add_to_trace(*call);  // a trace written at exit shows every call
  }
}

std::shared_ptr<Call> Pipeline::make_call(CallKind kind, const ModelExecutePlan& plan,
                                          int64_t num_microbatch, const RunConfig& cfg,
                                          bool saves_for_backward,
                                          std::shared_ptr<ForwardRecord> record) {
  const int64_t m = num_microbatch;
  auto call = std::make_shared<Call>();
  call->model = ModelView{name_,     &layers_, &store_,        seed_,
                          rank_ * m, &gate_,   gate_.issued(), unwritten_buffers_};
  call->num_microbatch = m;
  call->grain = cfg.recompute_grain().value_or(RecomputeGrain::kStage);
  call->preserve_rng = cfg.preserve_rng_state().value_or(true);
  call->trace = Tracer::instance().on();
  call->backward_starts.assign(layers_.size(), 0);
  if (!record) {
    record = std::make_shared<ForwardRecord>();
    record->call_id = next_call_id_++;
    record->autocast = AutocastState::of_this_thread();  // on the caller's thread
    record->num_microbatch = m;
    record->stage_inputs.assign(layers_.size(), std::vector<Slot>(m));
    record->recompute_data.assign(layers_.size(), {});
    for (auto& per_layer : record->recompute_data) per_layer.resize(m);
  }
  call->record = std::move(record);
  if (kind == CallKind::kFused) {
    call->saves_for_backward = true;
    for (size_t s = 1; s < plan.bwd_plan.size(); ++s)
      call->backward_starts[plan.bwd_plan[s].begin] = 1;
  } else if (kind == CallKind::kForward) {
    call->saves_for_backward = saves_for_backward;
    for (const auto& r : plan.bwd_plan) call->backward_starts[r.begin] = saves_for_backward;
  }
  call->jobs = make_jobs(plan, kind);
  call->init_flow();
  return call;
}

void Pipeline::feed_inputs(Call& call, const MicrobatchInputs& inputs) {
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
void Pipeline::wait_for_callers_streams(const Call& call) {
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
void Pipeline::own_inputs(Call& call) {
  for (int64_t m = 0; m < call.num_microbatch; ++m)
    call.flow[0][m].value = clone_tensors(call.flow[0][m].value);
  wait_for_callers_streams(call);  // the copies of accelerator inputs
}

void Pipeline::submit(const std::shared_ptr<Call>& call, CallIssue issue) {
  // Each job goes to the device on which it is predicted to start first,
  // from the timer's estimates (scheduler.h); the call in flight still runs
  // its backward stages when `issue` is kAtLosses. Until every layer is
  // timed, round-robin: the planner's stand-in for time (parameter bytes)
  // is in other units than the ledger's milliseconds, which the pool's
  // other models share.
  std::vector<double> job_ms;
  if (std::optional<LayerCosts> costs = measured_layer_costs(timer_))
    job_ms = job_times_ms(call->jobs, *costs);
  devices_.dispatcher().assign(call->jobs, num_devices_, job_ms, call->num_microbatch, issue);
  call->programs = make_lane_programs(call->jobs, call->num_microbatch);
  call->find_readers();
  std::vector<int64_t> devices;
  std::vector<std::function<void(Device&)>> tasks;
  for (size_t j = 0; j < call->jobs.size(); ++j) {
    devices.push_back(call->jobs[j].device);
    tasks.push_back(
        [c = call.get(), j](Device& dev) { run_job(*c, j, dev); });  // the call outlives its jobs
  }
  devices_.pool().submit_batch(devices, tasks);
}

void Pipeline::finish(Call& call) {
  try {
    call.wait_all();
  } catch (...) {
    add_to_trace(call);
    throw;
  }
  record_layer_times(call, timer_);
  add_to_trace(call);
}

void Pipeline::start(const std::shared_ptr<Call>& call, bool overlap) {
  if (overlap) {
    own_inputs(*call);
    // The calls issued while this one runs upload the buffers its forward
    // writes, not the host buffers (written back when it is applied).
    if (has_buffers_)
      call->buffer_out = std::make_shared<BufferHandoff>(call->record->call_id, layers_.size());
  }
  // Submitted before the call in flight is finished: its jobs queue behind
  // that call's last backward stages.
  submit(call, last_call_overlaps_ ? CallIssue::kAtLosses : CallIssue::kAtEnd);
  last_call_overlaps_ = overlap;
  if (call->buffer_out) {
    unwritten_buffers_ = call->buffer_out;
    unwritten_call_ = call;
  }
  try {
    finish_in_flight();
  } catch (...) {
    // The earlier call's failure: this one stops and changes nothing.
    in_flight_ = call;
    cancel_in_flight(std::current_exception());
  }
  in_flight_ = call;
  if (!call->wait_losses()) {
    in_flight_.reset();
    last_call_overlaps_ = false;
    forget_buffers_of(*call);
    finish(*call);  // rethrows the failure
  }
}

void Pipeline::finish_in_flight() {
  if (!in_flight_) return;
  std::shared_ptr<Call> call = std::move(in_flight_);
  in_flight_.reset();
  try {
    finish(*call);
  } catch (...) {
    forget_buffers_of(*call);
    throw;
  }
  apply(*call);
}

void Pipeline::discard_in_flight() {
  if (!in_flight_) return;
  std::shared_ptr<Call> call = std::move(in_flight_);
  in_flight_.reset();
  forget_buffers_of(*call);
  finish(*call);
}

void Pipeline::cancel_in_flight(std::exception_ptr error) {
  std::shared_ptr<Call> call = std::move(in_flight_);
  in_flight_.reset();
  if (call) {
    call->fail(std::make_exception_ptr(std::runtime_error("cancelled")), "");
    forget_buffers_of(*call);
    try {
      call->wait_all();
    } catch (...) {
    }
  }
  std::rethrow_exception(error);
}

void Pipeline::run(const std::shared_ptr<Call>& call) {
  finish_in_flight();
  last_call_overlaps_ = false;
  submit(call, CallIssue::kAtEnd);
  finish(*call);
}

void Pipeline::apply(Call& call) {
  gradients_.add(call.take_gradients());
  apply_buffers(call);
}

std::shared_ptr<GradientsInFlight> Pipeline::hand_to_step() {
  if (!in_flight_) return nullptr;
  auto gradients = std::make_shared<GradientsInFlight>(in_flight_);
  handed_.push_back({std::move(in_flight_), gradients});
  in_flight_.reset();
  return gradients;
}

void Pipeline::finish_handed_calls(bool wait) {
  while (!handed_.empty()) {
    if (!wait && !handed_.front().gradients->done()) return;
    std::shared_ptr<Call> call = std::move(handed_.front().call);
    handed_.erase(handed_.begin());
    try {
      finish(*call);
    } catch (...) {  // the step reports the failure
      forget_buffers_of(*call);
      continue;
    }
    apply_buffers(*call);  // its gradients are the step's
  }
}

void Pipeline::make_host_buffers_current() {
  if (!unwritten_buffers_) return;
  if (in_flight_ && in_flight_->buffer_out == unwritten_buffers_) {
    finish_in_flight();
  } else {
    finish_handed_calls(/*wait=*/true);
  }
}

void Pipeline::add_to_trace(const Call& call) {
  if (!call.trace) return;
  try {
    Tracer::instance().add(call_trace_events(call));
  } catch (const std::exception& e) {
    TORCH_WARN("RoundPipe: a call's events could not be added to the trace: ", e.what());
  }
}

// The host buffers <- what `call`'s forward left, unless a later call's are
// there already (a call handed to a step may be applied after calls issued
// later). A buffer no call wrote since the host buffers were written is the
// host buffer itself: nothing to copy.
void Pipeline::apply_buffers(const Call& call) {
  const int64_t id = call.record ? call.record->call_id : -1;
  bool any = false;
  for (const auto& job_buffers : call.buffers) any = any || !job_buffers.empty();
  if (!any || id <= host_buffers_call_) return;
  for (const auto& job_buffers : call.buffers) {
    for (const auto& [l, values] : job_buffers) {
      NamedTensors host = layers_[l]->named_buffers();
      for (size_t i = 0; i < values.size(); ++i) {
        if (values[i].defined() && !values[i].is_same(host[i].second)) {
          host[i].second.detach().copy_(values[i]);
        }
      }
    }
  }
  host_buffers_call_ = id;
  if (unwritten_buffers_ && unwritten_buffers_->call_id() <= id) unwritten_buffers_.reset();
}

void Pipeline::forget_buffers_of(const Call& call) {
  if (unwritten_buffers_ && call.buffer_out == unwritten_buffers_) unwritten_buffers_.reset();
}

void Pipeline::load_state(const State& s) {
  seed_ = s.seed;
  next_call_id_ = s.next_call_id;
  host_buffers_call_ = -1;  // the loaded buffers are the latest
  unwritten_buffers_.reset();
}

}  // namespace roundpipe
