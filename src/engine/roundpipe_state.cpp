// RoundPipe's public functions over the model's state: steps, synchronize,
// parameters and state dicts; the process-wide optimizer switches.
#include <ATen/ATen.h>

#include <atomic>
#include <unordered_map>

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

void RoundPipe::step(StepFn step_fn, bool is_async) {
  ModelUseLock::Scope use(impl_->use, "step");
  impl_->step(std::move(step_fn), is_async);
}

void RoundPipe::synchronize() {
  ModelUseLock::Scope use(impl_->use, "synchronize");
  impl_->synchronize();
}

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
  impl_->optimizer.wait_published();
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
  // On the optimizer thread (a step_fn) it waits for nothing.
  c10::optional<ModelUseLock::Scope> use;
  if (!impl_->optimizer.on_this_thread()) use.emplace(impl_->use, "state_dict");
  impl_->wait_state_current();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t l = 0; l < impl_->layers.size(); ++l) {
    const std::string prefix = std::to_string(l) + ".";
    for (auto& [name, t] : impl_->layers[l]->named_parameters()) out.emplace_back(prefix + name, t);
    for (auto& [name, t] : impl_->layers[l]->named_buffers()) out.emplace_back(prefix + name, t);
  }
  return out;
}

void RoundPipe::load_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& state,
                                bool strict) {
  ModelUseLock::Scope use(impl_->use, "load_state_dict");
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
  impl_->optimizer.model_written();
  impl_->optimizer.copy_model_to_optimizer();
}

void RoundPipe::refresh_optimizer_copies() {
  ModelUseLock::Scope use(impl_->use, "refresh_optimizer_copies");
  impl_->quiesce();
  impl_->optimizer.model_written();
  impl_->optimizer.copy_model_to_optimizer();
}

}  // namespace roundpipe
