// The optimizer side: optimizer copies, gradient hand-off, the optimizer
// thread with its exact one-step delay, synchronize, state dicts.
#include <ATen/ATen.h>

#include <atomic>
#include <future>
#include <unordered_map>

#include "engine/model_impl.h"
#include "engine/optimizer_thread.h"
#include "engine/tracer.h"
#include "optim/kernels/kernels.h"
#include "roundpipe/optimizer.h"
#include "util/interrupt.h"

namespace roundpipe {
namespace {

std::atomic<int64_t> sync_warmup_steps{0};
thread_local int optimizer_ctx_depth = 0;

// The gradients one step hands to the optimizer copies.
struct PendingGrad {
  int64_t id;
  at::Tensor accumulated;  // fp32, from the calls (may be undefined)
  at::Tensor from_grad;    // the model parameter's .grad left by synchronize (may be undefined)
};

}  // namespace

void set_sync_warmup_steps(int64_t n) {
  TORCH_CHECK_VALUE(n >= 0, "set_sync_warmup_steps: n must be >= 0, got ", n);
  sync_warmup_steps.store(n);
}

int64_t get_sync_warmup_steps() { return sync_warmup_steps.load(); }

OptimizerCtx::OptimizerCtx() { ++optimizer_ctx_depth; }
OptimizerCtx::~OptimizerCtx() { --optimizer_ctx_depth; }
bool OptimizerCtx::active() { return optimizer_ctx_depth > 0; }

void RoundPipe::Impl::make_optimizer_copies(c10::optional<at::ScalarType> optim_dtype) {
  for (HostParam& p : store->params()) {
    if (!p.trainable()) continue;
    const at::ScalarType dtype = optim_dtype.value_or(p.master.scalar_type());
    TORCH_CHECK_TYPE(at::isFloatingType(dtype), "optim_dtype must be a floating-point type, got ", dtype);
    p.optim = p.master.detach().to(dtype, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true);
  }
  optimizer_thread = std::make_unique<WorkerThread>(detail::mark_optimizer_thread);
}

void RoundPipe::Impl::rethrow_step_error() {
  std::exception_ptr error;
  std::string context;
  {
    std::lock_guard<std::mutex> lock(optim_mu);
    std::swap(error, step_error);  // reported once; the model is usable after
    context = step_error_context;
  }
  if (error) rethrow_with_context(error, context);
}

void RoundPipe::Impl::drain_optimizer() {
  // Shared: an interrupted wait returns while the task is still queued.
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> drained = done->get_future();
  optimizer_thread->post([done] { done->set_value(); });
  wait_interruptibly(drained);
}

namespace {

// model parameter <- optimizer copy, cast to the model's dtype. fp32 -> bf16 /
// fp16 goes through the optimizers' SIMD conversion (bitwise as Tensor::to).
void write_one(HostParam& p) {
  const at::Tensor master = p.master.detach();
  const at::Tensor copy = p.optim.detach();
  const at::ScalarType to = master.scalar_type();
  if (copy.scalar_type() == at::kFloat && (to == at::kBFloat16 || to == at::kHalf) &&
      master.is_contiguous() && copy.is_contiguous() && master.device().is_cpu()) {
    optim::kernels::convert_to_lowp(copy.data_ptr<float>(), static_cast<uint16_t*>(master.data_ptr()),
                                    master.numel(),
                                    to == at::kBFloat16 ? optim::kernels::LowpKind::kBFloat16
                                                        : optim::kernels::LowpKind::kFloat16);
  } else {
    master.copy_(copy);
  }
}

}  // namespace

void RoundPipe::Impl::write_model_parameters(int64_t generation, Call* reading) {
  at::NoGradGuard no_grad;
  try {
    // Layer by layer, in model order (deepest first while a call still
    // reads them): each layer is released to the calls waiting for it as
    // soon as its parameters are written.
    for (int64_t i = 0; i < num_layers(); ++i) {
      const int64_t l = reading ? num_layers() - 1 - i : i;
      if (reading) reading->wait_read(l);
      for (int64_t id : store->layer(l).owned) {
        HostParam& p = store->params()[id];
        if (p.optim.defined()) write_one(p);
      }
      param_gate->mark_written(l, generation);
    }
  } catch (...) {
    param_gate->mark_all_written(generation);  // never leave a call waiting
    throw;
  }
}

void RoundPipe::Impl::step(StepFn step_fn, bool is_async) {
  TORCH_CHECK_VALUE(static_cast<bool>(step_fn), "step: step_fn is empty");
  // At most one step in flight: the optimizer's cost hides under an
  // iteration, and when it is longer the next step waits here.
  drain_optimizer();
  rethrow_step_error();
  const bool delayed = is_async && steps_issued + 1 > sync_warmup_steps;
  // A synchronous step leaves nothing running: the call in flight is
  // applied here (its buffers too), its failure raised before the step.
  if (!delayed) finish_in_flight();
  const int64_t k = ++steps_issued;
  detail::note_stepping_model(weak_from_this());  // where run_on_optimizer_thread goes
  model_behind_optimizer = delayed;

  // Gradients of every call issued so far, taken now (the user thread owns
  // them between calls); later calls accumulate afresh.
  auto pending = std::make_shared<std::vector<PendingGrad>>();
  auto& params = store->params();
  for (size_t id = 0; id < params.size(); ++id) {
    HostParam& p = params[id];
    if (!p.optim.defined()) continue;
    PendingGrad g{static_cast<int64_t>(id), std::move(p.grad), p.master.grad()};
    p.grad = at::Tensor();
    if (g.from_grad.defined()) p.master.mutable_grad().reset();
    if (g.accumulated.defined() || g.from_grad.defined()) pending->push_back(std::move(g));
  }
  // A forward_backward still in flight (iteration overlap): its gradients
  // are taken on the optimizer thread once its jobs are done.
  std::shared_ptr<Call> call = std::move(in_flight);
  in_flight.reset();
  // Calls issued from now on wait, layer by layer, for this step's write.
  const int64_t generation = param_gate->begin_write();
  const std::string context = "in RoundPipe model '" + name + "': step " + std::to_string(k);
  auto record = [this, context](std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(optim_mu);
    if (!step_error) {
      step_error = std::move(e);
      step_error_context = context;
    }
  };
  const bool trace = Tracer::instance().on();
  optimizer_thread->post([this, pending, call, step_fn = std::move(step_fn), delayed, record, generation, trace, k] {
    detail::begin_step_task();
    // Optimizer-row events of the timeline trace.
    auto add_event = [&](const std::string& what, double start_ms) {
      if (!trace) return;
      TraceEvent e;
      e.lane = TraceLane::kOptimizer;
      e.kind = "optimizer";
      e.name = what + " " + std::to_string(k);
      e.model = name;
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
        write_model_parameters(generation, call.get());
      } catch (...) {
        ok = false;
        record(std::current_exception());
      }
      add_event("write-back", start);
    }
    if (call) {
      try {
        call->wait_all();
      } catch (...) {  // its gradients are not applied, and this step_fn does not run
        ok = false;
        record(std::current_exception());
      }
      std::lock_guard<std::mutex> lock(optim_mu);
      finished_by_steps.push_back(call);  // timings and trace, on the user thread
    }
    const double step_start = host_now_ms();
    try {
      at::NoGradGuard no_grad;
      // As commit() would have added the call's gradients to the
      // accumulators (job order), then what synchronize() left in .grad.
      std::vector<at::Tensor> acc(store->params().size()), from_grad(store->params().size());
      for (const PendingGrad& g : *pending) {
        acc[g.id] = g.accumulated;
        from_grad[g.id] = g.from_grad;
      }
      if (call && ok) {
        for (const auto& job_grads : call->grads) {
          for (const auto& [id, grad] : job_grads) {
            if (!store->params()[id].optim.defined()) continue;
            acc[id] = acc[id].defined() ? acc[id].add_(grad) : grad.to(at::kFloat);
          }
        }
      }
      std::vector<at::Tensor> sums(store->params().size());  // by parameter id
      for (size_t id = 0; id < sums.size(); ++id) {
        at::Tensor sum = acc[id];
        if (from_grad[id].defined()) sum = sum.defined() ? sum + from_grad[id] : from_grad[id];
        sums[id] = std::move(sum);
      }
      auto hand_off = [&](int64_t id) {
        const at::Tensor& sum = sums[id];
        if (!sum.defined()) return;
        at::Tensor& optim = store->params()[id].optim;
        at::Tensor& grad = optim.mutable_grad();
        if (grad.defined()) {
          grad.add_(sum.to(optim.scalar_type()));
        } else {
          grad = sum.to(optim.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
        }
      };
      if (group) {
        reduce_gradients(*group, reduction, *store, sums, hand_off, "");
      } else {
        for (size_t id = 0; id < sums.size(); ++id) hand_off(static_cast<int64_t>(id));
      }
    } catch (...) {
      ok = false;
      record(std::current_exception());
    }
    if (ok) {
      try {
        OptimizerCtx redirect;  // parameters() means the optimizer copies in step_fn
        step_fn();
      } catch (...) {
        ok = false;
        record(std::current_exception());
      }
    }
    add_event("step", step_start);
    if (!delayed) {
      const double start = host_now_ms();
      try {
        if (ok) write_model_parameters(generation);
      } catch (...) {
        record(std::current_exception());
      }
      param_gate->mark_all_written(generation);
      add_event("write-back", start);
    }
  });
  if (!delayed) {
    param_gate->wait_all(generation);  // the model holds θ_k
    rethrow_step_error();
  }
}

void RoundPipe::Impl::synchronize() {
  quiesce();
  // After a delayed step the model holds θ_{k-1}; bring it to θ_k. (Only
  // then: a model trained directly, without step, keeps its own values.)
  if (model_behind_optimizer) write_model_parameters(param_gate->begin_write());
  model_behind_optimizer = false;
  // Pending gradients move to .grad (model dtype), where a later step finds them.
  for (HostParam& p : store->params()) {
    if (!p.grad.defined()) continue;
    at::Tensor& grad = p.master.mutable_grad();
    if (grad.defined()) {
      grad.add_(p.grad.to(grad.scalar_type()));
    } else {
      grad = p.grad.to(p.master.scalar_type());
    }
    p.grad = at::Tensor();
  }
}

void RoundPipe::step(StepFn step_fn, bool is_async) { impl_->step(std::move(step_fn), is_async); }

void RoundPipe::synchronize() { impl_->synchronize(); }

std::vector<std::pair<std::string, at::Tensor>> RoundPipe::optim_named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const HostParam& p : impl_->store->params()) {
    if (p.optim.defined()) out.emplace_back(p.name, p.optim);
  }
  return out;
}

std::vector<at::Tensor> RoundPipe::optim_parameters() const {
  std::vector<at::Tensor> out;
  for (auto& [name, t] : optim_named_parameters()) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> RoundPipe::named_parameters() const {
  if (OptimizerCtx::active()) return optim_named_parameters();
  impl_->wait_published();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const HostParam& p : impl_->store->params()) out.emplace_back(p.name, p.master);
  return out;
}

std::vector<at::Tensor> RoundPipe::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& [name, t] : named_parameters()) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> RoundPipe::state_dict() const {
  impl_->wait_state_current();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t l = 0; l < impl_->layers.size(); ++l) {
    const std::string prefix = std::to_string(l) + ".";
    for (auto& [name, t] : impl_->layers[l]->named_parameters()) out.emplace_back(prefix + name, t);
    for (auto& [name, t] : impl_->layers[l]->named_buffers()) out.emplace_back(prefix + name, t);
  }
  return out;
}

void RoundPipe::load_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& state, bool strict) {
  impl_->quiesce();
  std::unordered_map<std::string, at::Tensor> given;
  for (const auto& [name, t] : state) {
    TORCH_CHECK_VALUE(given.emplace(name, t).second, "load_state_dict: '", name,
                      "' appears more than once; pass each name once");
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (destination, source), checked first
  std::vector<std::string> missing;
  for (auto& [name, dst] : state_dict()) {
    auto it = given.find(name);
    if (it == given.end()) {
      missing.push_back(name);
      continue;
    }
    // Everything a copy could fail on is checked here, before any copy:
    // nothing is half-loaded.
    const at::Tensor& src = it->second;
    TORCH_CHECK_VALUE(src.defined(), "load_state_dict: '", name, "' is an undefined tensor");
    TORCH_CHECK_VALUE(!src.is_meta() && src.layout() == at::kStrided, "load_state_dict: '", name,
                      "' has no data to copy (a ", src.is_meta() ? "meta" : "non-dense", " tensor)");
    TORCH_CHECK_TYPE(!at::isComplexType(src.scalar_type()) || at::isComplexType(dst.scalar_type()),
                     "load_state_dict: '", name, "' is ", src.scalar_type(), " but the model's is ",
                     dst.scalar_type(), ": complex values cannot be loaded into a real tensor");
    TORCH_CHECK_VALUE(src.sizes() == dst.sizes(), "load_state_dict: '", name, "' has shape ",
                      src.sizes(), " but the model's is ", dst.sizes());
    copies.emplace_back(dst, it->second);
    given.erase(it);
  }
  if (strict) {
    TORCH_CHECK_VALUE(missing.empty(), "load_state_dict: missing ", missing.size(), " entries, e.g. '",
                      missing.empty() ? "" : missing.front(), "' (pass strict=false to allow)");
    TORCH_CHECK_VALUE(given.empty(), "load_state_dict: ", given.size(), " unexpected entries, e.g. '",
                      given.empty() ? "" : given.begin()->first, "' (pass strict=false to allow)");
  }
  at::NoGradGuard no_grad;
  for (auto& [dst, src] : copies) dst.detach().copy_(src);
  // Refresh the optimizer copies, or the next step would undo the load.
  impl_->model_behind_optimizer = false;
  impl_->copy_model_to_optimizer();
}

void RoundPipe::refresh_optimizer_copies() {
  impl_->quiesce();
  impl_->model_behind_optimizer = false;
  impl_->copy_model_to_optimizer();
}

void RoundPipe::Impl::copy_model_to_optimizer() {
  at::NoGradGuard no_grad;
  for (HostParam& p : store->params()) {
    if (p.optim.defined()) p.optim.detach().copy_(p.master.detach());
  }
}

}  // namespace roundpipe
