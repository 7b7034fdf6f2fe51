// The gradients a model's calls leave for its next step: one sum per
// parameter, on the host, in the dtype its optimizer copy is kept in when
// that is bf16 (the compact configuration: the one gradient copy a parameter
// has), in fp32 otherwise. This is the one place gradients are accumulated;
// its transitions are named:
//   add(grads)          a successful call's gradients, taken out of it in job
//                       order (so a sum does not depend on which devices ran
//                       the jobs)
//   take(store)         a step takes the sums of the parameters that have an
//                       optimizer copy; the calls after it sum afresh (the
//                       others stay, for synchronize)
//   take_model_grads()  a step also takes what synchronize() left in the
//                       parameters' .grad (add(other) sums them in)
//   move_to_model_grads()  synchronize(): the sums move to the parameters'
//                       .grad (model dtype), where a later step finds them
//
// A bf16 sum that receives a second term (several calls before a step, a
// parameter used by several stages) adds in fp32 and rounds stochastically
// (add_bf16_stochastic in optim/kernels/kernels.h), seeded by the parameter
// id and the call that added it: small terms are kept on average, and the
// result is the same on every run and for every device count.
//
// Thread-safety: none. The model's instance belongs to its user thread; an
// instance taken by a step belongs to the optimizer thread from then on.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace roundpipe {

class HostStore;
struct HostParam;

// A finished call's gradients, as its jobs downloaded them.
struct CallGradients {
  int64_t call_id = 0;  // its forward's: seeds the stochastic rounding of bf16 sums
  std::vector<std::vector<std::pair<int64_t, at::Tensor>>>
      by_job;  // [job]: (parameter id, host grad)
};

// The dtype a parameter's gradient sum is kept in: bf16 where its optimizer
// copy is bf16, fp32 otherwise.
at::ScalarType gradient_sum_dtype(const HostParam& p);

class GradientSums {
 public:
  // [parameter id]: the dtype its sum is kept in (kFloat or kBFloat16).
  explicit GradientSums(std::vector<at::ScalarType> dtypes = {});
  // From saved sums (checkpoints), indexed by parameter id; converted to
  // `dtypes` where they differ.
  GradientSums(std::vector<at::ScalarType> dtypes, std::vector<at::Tensor> sums);
  // gradient_sum_dtype of each parameter.
  static std::vector<at::ScalarType> sum_dtypes(const HostStore& store);

  // Sums a call's gradients in job order and lets go of them (their host
  // downloads are freed as soon as nothing else holds them).
  void add(CallGradients grads);
  // Out of place: `other`'s tensors may be the user's. `sr_step` seeds the
  // stochastic rounding of bf16 sums (distinct per use).
  void add(const GradientSums& other, uint64_t sr_step);
  GradientSums take(const HostStore& store);
  // The .grad of the parameters that have an optimizer copy, moved out of them.
  static GradientSums take_model_grads(HostStore& store);
  void move_to_model_grads(HostStore& store);

  bool empty() const;
  size_t size() const { return sums_.size(); }
  // [parameter id]: the sum, undefined where no gradient arrived.
  const std::vector<at::Tensor>& by_id() const { return sums_; }
  std::vector<at::Tensor>& by_id() { return sums_; }

 private:
  void add(int64_t id, const at::Tensor& grad, uint64_t sr_step);
  std::vector<at::ScalarType> dtypes_;
  std::vector<at::Tensor> sums_;
};

// `acc` += `x` for a gradient kept in `acc`'s dtype: a bf16 `acc` (updated in
// place; replaced by a contiguous copy first if it is not contiguous) rounds
// stochastically, seeded by `sr_seed` and `sr_step`; any other adds `x`
// converted to it.
void accumulate_gradient(at::Tensor& acc, const at::Tensor& x, uint64_t sr_seed, uint64_t sr_step);

}  // namespace roundpipe
