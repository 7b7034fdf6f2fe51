// The optimizer side (optimizer_side.h).
#include "engine/optimizer_side.h"

#include <ATen/ATen.h>

#include <future>

#include "engine/host_store.h"
#include "engine/model_use.h"
#include "engine/optimizer_thread.h"
#include "engine/trace_recorder.h"
#include "optim/kernels/kernels.h"
#include "roundpipe/optimizer.h"
#include "runtime/device.h"
#include "util/contextual_error.h"
#include "util/interrupt.h"

namespace roundpipe {
namespace {

// model parameter <- optimizer copy, cast to the model's dtype. fp32 -> bf16 /
// fp16 goes through the optimizers' SIMD conversion (bitwise as Tensor::to).
void write_one(HostParam& p) {
  const at::Tensor master = p.master.detach();
  const at::Tensor copy = p.optim.detach();
  const at::ScalarType to = master.scalar_type();
  if (copy.scalar_type() == at::kFloat && (to == at::kBFloat16 || to == at::kHalf) &&
      master.is_contiguous() && copy.is_contiguous() && master.device().is_cpu()) {
    optim::kernels::convert_to_lowp(copy.data_ptr<float>(),
                                    static_cast<uint16_t*>(master.data_ptr()), master.numel(),
                                    to == at::kBFloat16 ? optim::kernels::LowpKind::kBFloat16
                                                        : optim::kernels::LowpKind::kFloat16);
  } else {
    master.copy_(copy);
  }
}

}  // namespace

OptimizerSide::OptimizerSide(std::string name, HostStore& store, int64_t num_layers,
                             int64_t sync_warmup_steps, std::shared_ptr<ProcessGroup> group,
                             GradientReduction reduction)
    : name_(std::move(name)),
      store_(store),
      num_layers_(num_layers),
      sync_warmup_steps_(sync_warmup_steps),
      gate_(std::make_unique<ParamGate>(num_layers)),
      group_(std::move(group)),
      reduction_(reduction) {
  if (group_) {
    // Not on an optimizer thread: in a step_fn, or the model's own
    // collectives, the steps are what is running.
    attachment_ = std::make_unique<GroupAttachment>(group_, name_, [this] {
      if (thread_ && !on_optimizer_thread()) drain();
    });
  }
  thread_ = std::make_unique<WorkerThread>(detail::mark_optimizer_thread);
}

OptimizerSide::~OptimizerSide() = default;

void OptimizerSide::make_copies(c10::optional<at::ScalarType> optim_dtype) {
  for (HostParam& p : store_.params()) {
    if (!p.trainable()) continue;
    const at::ScalarType dtype = optim_dtype.value_or(p.master.scalar_type());
    TORCH_CHECK_TYPE(at::isFloatingType(dtype), "optim_dtype must be a floating-point type, got ",
                     dtype);
    p.optim =
        p.master.detach().to(dtype, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true);
  }
  note_model_versions();
}

void OptimizerSide::note_model_versions() {
  const auto& params = store_.params();
  model_versions_.resize(params.size());
  for (size_t id = 0; id < params.size(); ++id) note_version(static_cast<int64_t>(id));
}

void OptimizerSide::take_changed_parameters() {
  at::NoGradGuard no_grad;
  auto& params = store_.params();
  for (size_t id = 0; id < params.size(); ++id) {
    HostParam& p = params[id];
    if (!p.optim.defined() || p.master._version() == model_versions_[id]) continue;
    p.optim.detach().copy_(p.master.detach());
    note_version(static_cast<int64_t>(id));
  }
}

void OptimizerSide::copy_model_to_optimizer() {
  at::NoGradGuard no_grad;
  for (HostParam& p : store_.params()) {
    if (p.optim.defined()) p.optim.detach().copy_(p.master.detach());
  }
  note_model_versions();
}

void OptimizerSide::rethrow_step_error() {
  std::exception_ptr error;
  std::string context;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::swap(error, step_error_);  // reported once; the model is usable after
    context = step_error_context_;
  }
  if (error) rethrow_with_context(error, context);
}

void OptimizerSide::record_error(std::exception_ptr error, const std::string& context) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!step_error_) {
    step_error_ = std::move(error);
    step_error_context_ = context;
  }
}

void OptimizerSide::drain() {
  // Shared: an interrupted wait returns while the task is still queued.
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> drained = done->get_future();
  thread_->post([done] { done->set_value(); });
  wait_interruptibly(drained);
}

void OptimizerSide::wait_published() const {
  if (!thread_->on_this_thread()) gate_->wait_all(gate_->issued());
}

void OptimizerSide::write_model_parameters(int64_t generation, const GradientsInFlight* reading) {
  at::NoGradGuard no_grad;
  try {
    // Layer by layer, in model order (deepest first while a call still
    // reads them, the order it releases them in): each layer is released
    // to the calls waiting for it as soon as its parameters are written.
    for (int64_t i = 0; i < num_layers_; ++i) {
      const int64_t l = reading ? num_layers_ - 1 - i : i;
      if (reading) reading->wait_read(l);
      for (int64_t id : store_.layer(l).owned) {
        HostParam& p = store_.params()[id];
        if (!p.optim.defined()) continue;
        write_one(p);
        note_version(id);
      }
      gate_->mark_written(l, generation);
    }
  } catch (...) {
    gate_->mark_all_written(generation);  // never leave a call waiting
    throw;
  }
}

bool OptimizerSide::begin_step(bool is_async) {
  // At most one step in flight: the optimizer's cost hides under an
  // iteration, and when it is longer the next step waits here.
  drain();
  rethrow_step_error();
  return is_async && steps_issued_ + 1 > sync_warmup_steps_;
}

void OptimizerSide::step(StepFn step_fn, bool delayed, GradientSums gradients,
                         GradientSums model_grads, std::shared_ptr<GradientsInFlight> in_flight) {
  take_changed_parameters();  // the optimizer thread is idle (begin_step)
  const int64_t k = ++steps_issued_;
  // A synchronous step after a delayed one: the model still holds the step
  // before the last one, and gets the last one's result before step_fn runs.
  const bool catch_up = !delayed && model_behind_;
  model_behind_ = delayed;
  // Calls issued from now on wait, layer by layer, for this step's write.
  const int64_t generation = gate_->begin_write();
  const bool trace = Tracer::instance().on();
  auto taken = std::make_shared<std::pair<GradientSums, GradientSums>>(std::move(gradients),
                                                                       std::move(model_grads));
  thread_->post([this, taken, call = std::move(in_flight), step_fn = std::move(step_fn), delayed,
                 catch_up, generation, k, trace] {
    run_step(step_fn, delayed, catch_up, taken->first, taken->second, call.get(), generation, k,
             trace);
  });
  if (!delayed) {
    gate_->wait_all(generation);  // the model holds θ_k
    rethrow_step_error();
  }
}

void OptimizerSide::run_step(const StepFn& step_fn, bool delayed, bool catch_up,
                             GradientSums& gradients, const GradientSums& model_grads,
                             GradientsInFlight* call, int64_t generation, int64_t k, bool trace) {
  detail::begin_step_task();
  const std::string context = "in RoundPipe model '" + name_ + "': step " + std::to_string(k);
  // Optimizer-row events of the timeline trace.
  auto add_event = [&](const std::string& what, double start_ms) {
    if (!trace) return;
    TraceEvent e;
    e.lane = TraceLane::kOptimizer;
    e.kind = "optimizer";
    e.name = what + " " + std::to_string(k);
    e.model = name_;
    e.start_us = start_ms * 1000.0;
    e.dur_us = (host_now_ms() - start_ms) * 1000.0;
    Tracer::instance().add({std::move(e)});
  };
  bool ok = true;
  if (delayed) {
    // One-step delay: the next calls see the copies as they are before
    // this step_fn runs (θ_{k-1}); written first, so they can start.
    const double start = host_now_ms();
    try {
      write_model_parameters(generation, call);
    } catch (...) {
      ok = false;
      record_error(std::current_exception(), context);
    }
    add_event("write-back", start);
  }
  if (call) {
    try {
      call->wait();  // the pipeline applies the rest of the call from here on
    } catch (...) {  // its gradients are not applied, and this step_fn does not run
      ok = false;
      record_error(std::current_exception(), context);
    }
  }
  const double step_start = host_now_ms();
  // Handed off even when the call failed: with a process group, every
  // process runs the same collectives.
  try {
    at::NoGradGuard no_grad;
    if (call && ok)
      gradients.add(call->take());  // after the ones summed before it, as Pipeline::apply would
    // Seeds of the stochastic rounding of bf16 sums: apart from the calls'
    // (GradientSums::add) by the top bits, distinct per step.
    const uint64_t step_seed = static_cast<uint64_t>(k);
    gradients.add(model_grads, (uint64_t{1} << 63) | step_seed);
    std::vector<at::Tensor>& sums = gradients.by_id();
    for (size_t id = 0; id < sums.size(); ++id) {
      if (!store_.params()[id].optim.defined()) sums[id] = at::Tensor();  // no copy to hand it to
    }
    // The sum becomes the copy's .grad without a copy when it is in the
    // copy's dtype (the engine owns it: GradientSums copies the user's
    // tensors), so a parameter holds one gradient at a time.
    auto hand_off = [&](int64_t id) {
      at::Tensor& sum = sums[id];
      at::Tensor& optim = store_.params()[id].optim;
      if (!sum.defined() || !optim.defined()) return;
      at::Tensor& grad = optim.mutable_grad();
      if (grad.defined()) {
        accumulate_gradient(grad, sum, static_cast<uint64_t>(id), (uint64_t{1} << 62) | step_seed);
      } else if (sum.scalar_type() == optim.scalar_type() && !sum.is_view()) {
        grad = sum;
      } else {  // a view (of a reduction's bucket) is copied: optimizers detach .grad in place
        grad = sum.to(optim.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      }
      sum = at::Tensor();
    };
    if (group_) {
      reduce_gradients(*group_, reduction_, store_, sums, hand_off, "");
    } else {
      for (size_t id = 0; id < sums.size(); ++id) hand_off(static_cast<int64_t>(id));
    }
  } catch (...) {
    ok = false;
    record_error(std::current_exception(), context);
  }
  if (catch_up) {
    // So that a step_fn that fails leaves the model at the last successful
    // step (no call reads the model: a synchronous step finished them all).
    try {
      at::NoGradGuard no_grad;
      auto& params = store_.params();
      for (size_t id = 0; id < params.size(); ++id) {
        if (!params[id].optim.defined()) continue;
        write_one(params[id]);
        note_version(static_cast<int64_t>(id));
      }
    } catch (...) {
      ok = false;
      record_error(std::current_exception(), context);
    }
  }
  if (ok) {
    try {
      OptimizerCtx redirect;  // parameters() means the optimizer copies in step_fn
      UserCodeScope user(name_, "the step_fn");
      step_fn();
    } catch (...) {
      ok = false;
      record_error(std::current_exception(), context);
    }
  }
  add_event("step", step_start);
  if (!delayed) {
    const double start = host_now_ms();
    try {
      if (ok) write_model_parameters(generation);
    } catch (...) {
      record_error(std::current_exception(), context);
    }
    gate_->mark_all_written(generation);
    add_event("write-back", start);
  }
}

void OptimizerSide::catch_up_model() {
  // Only after a delayed step: a model trained directly, without step,
  // keeps its own values.
  if (model_behind_) write_model_parameters(gate_->begin_write());
  model_behind_ = false;
}

}  // namespace roundpipe
