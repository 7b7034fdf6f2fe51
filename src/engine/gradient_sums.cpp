#include "engine/gradient_sums.h"

#include <ATen/ATen.h>

#include "engine/call.h"
#include "engine/host_store.h"

namespace roundpipe {

void GradientSums::add(int64_t id, const at::Tensor& grad) {
  at::Tensor& sum = sums_.at(static_cast<size_t>(id));
  if (sum.defined()) {
    sum.add_(grad);
  } else {
    // An fp32 download with memory of its own is kept as it is; one that
    // shares a download run's buffer is copied, or it would keep the whole
    // run (up to 16 MiB of page-locked memory) until the step.
    const bool shares_run = grad.layout() == at::kStrided && grad.storage().nbytes() > grad.nbytes();
    sum = grad.scalar_type() == at::kFloat && shares_run ? grad.clone() : grad.to(at::kFloat);
  }
}

void GradientSums::add(const Call& call) {
  for (const auto& job_grads : call.grads) {
    for (const auto& [id, grad] : job_grads) add(id, grad);
  }
}

void GradientSums::add(const GradientSums& other) {
  for (size_t id = 0; id < sums_.size(); ++id) {
    const at::Tensor& grad = other.sums_.at(id);
    if (!grad.defined()) continue;
    at::Tensor& sum = sums_[id];
    sum = sum.defined() ? sum + grad : grad;
  }
}

GradientSums GradientSums::take_model_grads(HostStore& store) {
  auto& params = store.params();
  GradientSums taken(params.size());
  for (size_t id = 0; id < params.size(); ++id) {
    HostParam& p = params[id];
    if (!p.optim.defined() || !p.master.grad().defined()) continue;
    taken.sums_[id] = p.master.grad();
    p.master.mutable_grad().reset();
  }
  return taken;
}

GradientSums GradientSums::take(const HostStore& store) {
  GradientSums taken(sums_.size());
  for (size_t id = 0; id < sums_.size(); ++id) {
    if (!store.params()[id].optim.defined()) continue;
    taken.sums_[id] = std::move(sums_[id]);
    sums_[id] = at::Tensor();
  }
  return taken;
}

void GradientSums::move_to_model_grads(HostStore& store) {
  auto& params = store.params();
  for (size_t id = 0; id < params.size(); ++id) {
    at::Tensor& sum = sums_[id];
    if (!sum.defined()) continue;
    at::Tensor& grad = params[id].master.mutable_grad();
    if (grad.defined()) {
      grad.add_(sum.to(grad.scalar_type()));
    } else {
      grad = sum.to(params[id].master.scalar_type());
    }
    sum = at::Tensor();
  }
}

bool GradientSums::empty() const {
  for (const at::Tensor& s : sums_) {
    if (s.defined()) return false;
  }
  return true;
}

}  // namespace roundpipe
