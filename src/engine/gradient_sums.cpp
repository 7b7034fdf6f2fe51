#include "engine/gradient_sums.h"

#include <ATen/ATen.h>

#include "engine/host_store.h"
#include "optim/kernels/kernels.h"

namespace roundpipe {

void accumulate_gradient(at::Tensor& acc, const at::Tensor& x, uint64_t sr_seed, uint64_t sr_step) {
  if (acc.scalar_type() != at::kBFloat16) {
    acc.add_(x.to(acc.scalar_type()));
    return;
  }
  TORCH_INTERNAL_ASSERT(acc.numel() == x.numel());
  if (!acc.is_contiguous()) acc = acc.contiguous();  // e.g. a .grad the user set
  const at::Tensor xs = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  optim::kernels::add_bf16_stochastic(
      static_cast<uint16_t*>(acc.data_ptr()),
      xs.scalar_type() == at::kBFloat16 ? static_cast<const uint16_t*>(xs.const_data_ptr()) : nullptr,
      xs.scalar_type() == at::kFloat ? xs.const_data_ptr<float>() : nullptr, acc.numel(), sr_seed,
      sr_step);
}

GradientSums::GradientSums(std::vector<at::ScalarType> dtypes)
    : dtypes_(std::move(dtypes)), sums_(dtypes_.size()) {}

GradientSums::GradientSums(std::vector<at::ScalarType> dtypes, std::vector<at::Tensor> sums)
    : dtypes_(std::move(dtypes)), sums_(std::move(sums)) {
  TORCH_CHECK(sums_.size() == dtypes_.size(), "gradient sums: ", sums_.size(),
              " saved for a model of ", dtypes_.size(), " parameters");
  for (size_t id = 0; id < sums_.size(); ++id) {
    if (sums_[id].defined()) sums_[id] = sums_[id].to(dtypes_[id]);
  }
}

at::ScalarType gradient_sum_dtype(const HostParam& p) {
  return p.optim.defined() && p.optim.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
}

std::vector<at::ScalarType> GradientSums::sum_dtypes(const HostStore& store) {
  std::vector<at::ScalarType> dtypes;
  for (const HostParam& p : store.params()) dtypes.push_back(gradient_sum_dtype(p));
  return dtypes;
}

void GradientSums::add(int64_t id, const at::Tensor& grad, uint64_t sr_step) {
  at::Tensor& sum = sums_.at(static_cast<size_t>(id));
  const at::ScalarType dtype = dtypes_[static_cast<size_t>(id)];
  if (sum.defined()) {
    accumulate_gradient(sum, grad, static_cast<uint64_t>(id), sr_step);
  } else {
    // A download with memory of its own is kept as it is; one that shares a
    // download run's buffer is copied, or it would keep the whole run (up to
    // 16 MiB of page-locked memory) until the step.
    const bool shares_run = grad.layout() == at::kStrided && grad.storage().nbytes() > grad.nbytes();
    sum = grad.scalar_type() == dtype && shares_run ? grad.clone() : grad.to(dtype);
  }
}

void GradientSums::add(CallGradients grads) {
  // Seeded by the call (its forward's id: the same in every run) and the job.
  const auto call_id = static_cast<uint64_t>(grads.call_id);
  for (size_t j = 0; j < grads.by_job.size(); ++j) {
    for (const auto& [id, grad] : grads.by_job[j]) add(id, grad, (call_id << 16) + j);
  }
}

void GradientSums::add(const GradientSums& other, uint64_t sr_step) {
  for (size_t id = 0; id < sums_.size(); ++id) {
    const at::Tensor& grad = other.sums_.at(id);
    if (!grad.defined()) continue;
    at::Tensor& sum = sums_[id];
    if (sum.defined()) {
      at::Tensor fresh = sum.clone();  // `sum` may be a call's download, still referenced
      accumulate_gradient(fresh, grad, id, sr_step);
      sum = std::move(fresh);
    } else {
      sum = grad.to(dtypes_[id], /*non_blocking=*/false, /*copy=*/true);
    }
  }
}

GradientSums GradientSums::take_model_grads(HostStore& store) {
  auto& params = store.params();
  GradientSums taken(sum_dtypes(store));
  for (size_t id = 0; id < params.size(); ++id) {
    HostParam& p = params[id];
    if (!p.optim.defined() || !p.master.grad().defined()) continue;
    taken.sums_[id] = p.master.grad();
    p.master.mutable_grad().reset();
  }
  return taken;
}

GradientSums GradientSums::take(const HostStore& store) {
  GradientSums taken(dtypes_);
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
