// roundpipe::optim::SGD: a vectorized CPU drop-in for torch::optim::SGD,
// with torch.optim.SGD's `maximize` added.
//
// Same update as torch.optim.SGD (single-tensor implementation, same order of
// operations), in one fused pass over memory per parameter, explicit SIMD
// chosen at run time (ROUNDPIPE_SIMD=scalar|avx2|avx512 forces one) and
// multithreaded over at::get_num_threads() threads; bitwise the same results
// for every SIMD path and thread count:
//   g = maximize ? -grad : grad
//   if weight_decay != 0: g = g + weight_decay * p
//   if momentum != 0: buf = (first step) ? g : momentum * buf + (1 - dampening) * g
//                     g = nesterov ? g + momentum * buf : buf
//   p = p - lr * g
//
//   roundpipe::optim::SGD opt(model->parameters(),
//                             roundpipe::optim::SGDOptions(0.1).momentum(0.9));
//
// Parameters: float32, contiguous, dense (strided), CPU tensors, and so must
// their gradients be; c10::TypeError (dtype, layout, device) or
// c10::ValueError (non-contiguous, undefined, size mismatch) otherwise, naming
// the parameter's index over all groups. Checked at construction and at every
// step(), before anything is modified. Parameters without a gradient are
// skipped.
//
// State: torch::optim::SGDParamState (momentum_buffer) per parameter, only
// when momentum != 0, keyed as libtorch keys it; save()/load() archives have
// torch::optim::SGD's layout plus the option key `maximize` (false when
// absent on load).
//
// Thread-safety: thread-compatible (one thread at a time per optimizer).
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <vector>

namespace roundpipe {
namespace optim {

// Options of SGD: libtorch's names and defaults, plus `maximize`. lr has no
// default, as in libtorch. Validated at construction (defaults and every group
// given) and at every step(): c10::ValueError unless lr >= 0, momentum >= 0,
// weight_decay >= 0, and nesterov implies momentum > 0 and dampening == 0.
struct SGDOptions : public torch::optim::OptimizerCloneableOptions<SGDOptions> {
  // Implicit, like torch::optim::SGDOptions, so `SGD(params, 0.1)` works.
  SGDOptions(double lr);  // NOLINT(google-explicit-constructor)

  // Learning rate (required).
  TORCH_ARG(double, lr);
  // Momentum factor. Default 0 (no momentum buffer).
  TORCH_ARG(double, momentum) = 0;
  // Dampening of the gradient's contribution to the momentum. Default 0.
  TORCH_ARG(double, dampening) = 0;
  // L2 penalty added to the gradient. Default 0.
  TORCH_ARG(double, weight_decay) = 0;
  // Nesterov momentum. Default false.
  TORCH_ARG(bool, nesterov) = false;
  // Maximize the objective (step along +gradient). Default false.
  TORCH_ARG(bool, maximize) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override;
  void set_lr(const double lr) override;
  friend bool operator==(const SGDOptions& lhs, const SGDOptions& rhs);
};

class SGD : public torch::optim::Optimizer {
 public:
  // Throws (see the top of this file) for invalid options or parameters.
  explicit SGD(std::vector<torch::optim::OptimizerParamGroup> param_groups, SGDOptions defaults);
  explicit SGD(std::vector<torch::Tensor> params, SGDOptions defaults);

  // One update of every parameter that has a gradient; returns closure()
  // (run with grad mode on) if given, else an undefined tensor.
  torch::Tensor step(LossClosure closure = nullptr) override;

  // step(), also writing each updated parameter into a bf16/fp16 copy in the
  // same pass; `lowp_copies` as for Adam::step_with_lowp_copy (one entry per
  // parameter in group order, undefined = none; contiguous CPU bfloat16 or
  // float16 with the parameter's numel). Copies are bitwise param.to(dtype).
  void step_with_lowp_copy(const std::vector<torch::Tensor>& lowp_copies);

  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  void run_step(const std::vector<torch::Tensor>* lowp_copies);
};

}  // namespace optim
}  // namespace roundpipe
