// The engine's steps and the model's state: step, synchronize, parameters,
// state dicts (model_impl.h).
#include <ATen/ATen.h>
#include <malloc.h>

#include <unordered_map>

#include "engine/model_impl.h"
#include "engine/optimizer_thread.h"
#include "roundpipe/optimizer.h"

namespace roundpipe {

void RoundPipe::Impl::step(StepFn step_fn, bool is_async) {
  ModelUseLock::Scope use(use_, "step");
  TORCH_CHECK_VALUE(static_cast<bool>(step_fn), "step: step_fn is empty");
  const bool delayed = optimizer_.begin_step(is_async);
  // A synchronous step leaves nothing running: the call in flight is
  // applied here (its buffers too), its failure raised before the step.
  if (!delayed) pipeline_.finish_in_flight();
  // Where run_on_optimizer_thread goes (the optimizer side lives as long as
  // the model it is posted through is held).
  detail::note_stepping_model(weak_from_this(), [side = &optimizer_](std::function<void()> task) {
    side->post(std::move(task));
  });
  // The gradients of every call issued so far: those applied, then the call
  // in flight's (summed on the optimizer thread once its jobs are done),
  // then what synchronize() left in .grad. Later calls sum afresh.
  GradientSums taken = gradients_.take(*store_);
  GradientSums model_grads = GradientSums::take_model_grads(*store_);
  optimizer_.step(std::move(step_fn), delayed, std::move(taken), std::move(model_grads),
                  pipeline_.hand_to_step());
}

void RoundPipe::Impl::synchronize() {
  ModelUseLock::Scope use(use_, "synchronize");
  quiesce();
  optimizer_.catch_up_model();
  gradients_.move_to_model_grads(*store_);
  // Nothing is running: what the allocator kept of the steps' freed
  // gradients and buffers goes back to the system (a training loop does not
  // call synchronize, so the pages are not faulted in again every step).
  malloc_trim(0);
}

std::vector<std::pair<std::string, at::Tensor>> RoundPipe::Impl::optim_named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const HostParam& p : store_->params()) {
    if (p.optim.defined()) out.emplace_back(p.name, p.optim);
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> RoundPipe::Impl::named_parameters() const {
  if (OptimizerCtx::active()) return optim_named_parameters();
  optimizer_.wait_published();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const HostParam& p : store_->params()) out.emplace_back(p.name, p.master);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> RoundPipe::Impl::state_dict() {
  // On the optimizer thread (a step_fn) it waits for nothing.
  c10::optional<ModelUseLock::Scope> use;
  if (!optimizer_.on_this_thread()) use.emplace(use_, "state_dict");
  wait_state_current();
  return named_state();
}

void RoundPipe::Impl::load_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& state,
                                      bool strict) {
  ModelUseLock::Scope use(use_, "load_state_dict");
  quiesce();
  std::unordered_map<std::string, at::Tensor> given;
  for (const auto& [name, t] : state) {
    TORCH_CHECK_VALUE(given.emplace(name, t).second, "load_state_dict: '", name,
                      "' appears more than once; pass each name once");
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (destination, source), checked first
  std::vector<std::string> missing;
  for (auto& [name, dst] : named_state()) {  // current: quiesced above
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
                      "' has no data to copy (a ", src.is_meta() ? "meta" : "non-dense",
                      " tensor)");
    TORCH_CHECK_TYPE(!at::isComplexType(src.scalar_type()) || at::isComplexType(dst.scalar_type()),
                     "load_state_dict: '", name, "' is ", src.scalar_type(), " but the model's is ",
                     dst.scalar_type(), ": complex values cannot be loaded into a real tensor");
    TORCH_CHECK_VALUE(src.sizes() == dst.sizes(), "load_state_dict: '", name, "' has shape ",
                      src.sizes(), " but the model's is ", dst.sizes());
    copies.emplace_back(dst, it->second);
    given.erase(it);
  }
  if (strict) {
    TORCH_CHECK_VALUE(missing.empty(), "load_state_dict: missing ", missing.size(),
                      " entries, e.g. '", missing.empty() ? "" : missing.front(),
                      "' (pass strict=false to allow)");
    TORCH_CHECK_VALUE(given.empty(), "load_state_dict: ", given.size(),
                      " unexpected entries, e.g. '", given.empty() ? "" : given.begin()->first,
                      "' (pass strict=false to allow)");
  }
  at::NoGradGuard no_grad;
  for (auto& [dst, src] : copies) dst.detach().copy_(src);
  // Refresh the optimizer copies, or the next step would undo the load.
  optimizer_.model_written();
  optimizer_.copy_model_to_optimizer();
}

void RoundPipe::Impl::refresh_optimizer_copies() {
  ModelUseLock::Scope use(use_, "refresh_optimizer_copies");
  quiesce();
  optimizer_.model_written();
  optimizer_.copy_model_to_optimizer();
}

}  // namespace roundpipe
