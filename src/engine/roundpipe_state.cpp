// RoundPipe's public functions over the model's state (model_state.cpp does
// the work); the process-wide optimizer switches.
#include <ATen/ATen.h>

#include <atomic>

#include "engine/model_impl.h"
#include "roundpipe/optimizer.h"

namespace roundpipe {
namespace {

std::atomic<int64_t> sync_warmup_steps{0};
thread_local int optimizer_ctx_depth = 0;

}  // namespace

void set_sync_warmup_steps(int64_t n) {
  TORCH_CHECK_VALUE(n >= 0, "set_sync_warmup_steps: n must be >= 0, got ", n);
  sync_warmup_steps.store(n);
}

int64_t get_sync_warmup_steps() { return sync_warmup_steps.load(); }

OptimizerCtx::OptimizerCtx() { ++optimizer_ctx_depth; }
OptimizerCtx::~OptimizerCtx() { --optimizer_ctx_depth; }
bool OptimizerCtx::active() { return optimizer_ctx_depth > 0; }

void RoundPipe::step(StepFn step_fn, bool is_async) { impl_->step(std::move(step_fn), is_async); }

void RoundPipe::synchronize() { impl_->synchronize(); }

std::vector<std::pair<std::string, at::Tensor>> RoundPipe::optim_named_parameters() const {
  return impl_->optim_named_parameters();
}

std::vector<at::Tensor> RoundPipe::optim_parameters() const {
  std::vector<at::Tensor> out;
  for (auto& [name, t] : optim_named_parameters()) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> RoundPipe::named_parameters() const {
  return impl_->named_parameters();
}

std::vector<at::Tensor> RoundPipe::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& [name, t] : named_parameters()) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> RoundPipe::state_dict() const {
  return impl_->state_dict();
}

void RoundPipe::load_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& state,
                                bool strict) {
  impl_->load_state_dict(state, strict);
}

void RoundPipe::refresh_optimizer_copies() { impl_->refresh_optimizer_copies(); }

}  // namespace roundpipe
