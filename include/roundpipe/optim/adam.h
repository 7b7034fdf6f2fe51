// roundpipe::optim::Adam and AdamW: vectorized CPU drop-ins for
// torch::optim::Adam / AdamW.
//
// Same update as torch.optim.Adam (PyTorch's single-tensor implementation,
// same order of operations; results agree within 1e-6 relative after 10
// steps), but one fused pass over memory per parameter (28 bytes per element:
// read p, g, m, v; write p, m, v), explicit SIMD (AVX-512, AVX2 or scalar,
// chosen at run time; ROUNDPIPE_SIMD=scalar|avx2|avx512 forces one) and
// multithreaded over at::get_num_threads() threads. Results are bitwise the
// same for every SIMD path and every thread count.
//
//   roundpipe::optim::Adam opt(model->parameters(),
//                              roundpipe::optim::AdamOptions(1e-3).weight_decay(0.01));
//   loss.backward();
//   opt.step();
//
// Parameters: float32, contiguous, dense (strided), CPU tensors, and so must
// their gradients be. Anything else throws at construction (for the parameters
// given then) or at step() (for parameters added later, gradients and loaded
// state): c10::TypeError for a wrong dtype, layout or device, c10::ValueError
// for a non-contiguous or undefined tensor or a size mismatch. The message
// names the parameter by its index over all parameter groups (and its group
// and position). step() checks everything before it modifies anything.
// Parameters whose .grad() is undefined are skipped, as in libtorch.
//
// State: torch::optim::AdamParamState per parameter (step, exp_avg,
// exp_avg_sq, max_exp_avg_sq when amsgrad), in Optimizer::state() under the
// same key libtorch uses, so save()/load() archives have libtorch's layout
// (plus two option keys, maximize and decoupled_weight_decay, which loading
// treats as false when absent). An archive written by torch::optim::Adam can be
// loaded.
//
// Thread-safety: thread-compatible, like torch::optim::Optimizer: one thread
// at a time may call a method; step() itself uses libtorch's intra-op pool.
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <tuple>
#include <utility>
#include <vector>

namespace roundpipe {
namespace optim {

// Options of Adam, with libtorch's names and defaults plus those of
// torch.optim.Adam that libtorch 1.13 lacks. Validated when an optimizer is
// constructed (defaults and every group given) and at every step() (every
// group): c10::ValueError unless lr >= 0, 0 <= beta1 < 1, 0 <= beta2 < 1,
// eps >= 0 and weight_decay >= 0 (NaN fails all of these).
struct AdamOptions : public torch::optim::OptimizerCloneableOptions<AdamOptions> {
  // Implicit, like torch::optim::AdamOptions, so `Adam(params, 1e-2)` works.
  AdamOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor)

  // Learning rate. Default 1e-3.
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  // Decay rates of the first and second moment averages. Default (0.9, 0.999).
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  // Added to the denominator. Default 1e-8.
  TORCH_ARG(double, eps) = 1e-8;
  // L2 penalty (added to the gradient), or with decoupled_weight_decay the
  // AdamW decay p *= 1 - lr * weight_decay. Default 0.
  TORCH_ARG(double, weight_decay) = 0;
  // Normalize by the running maximum of the second moment. Default false.
  TORCH_ARG(bool, amsgrad) = false;
  // Maximize the objective (step along +gradient). Default false.
  TORCH_ARG(bool, maximize) = false;
  // Decoupled weight decay: AdamW. Default false.
  TORCH_ARG(bool, decoupled_weight_decay) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override;
  void set_lr(const double lr) override;
  friend bool operator==(const AdamOptions& lhs, const AdamOptions& rhs);
};

// AdamOptions with AdamW's defaults: weight_decay 1e-2 and
// decoupled_weight_decay true (torch.optim.AdamW). Setters return
// AdamOptions&, so chains like AdamWOptions(1e-3).betas({0.9, 0.95}) work.
struct AdamWOptions : public AdamOptions {
  AdamWOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor)
};

class Adam : public torch::optim::Optimizer {
 public:
  // Throws (see the top of this file) for invalid options or parameters.
  explicit Adam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                AdamOptions defaults = {});
  explicit Adam(std::vector<torch::Tensor> params, AdamOptions defaults = {});

  // One update of every parameter that has a gradient; returns closure()
  // (run with grad mode on) if given, else an undefined tensor.
  torch::Tensor step(LossClosure closure = nullptr) override;

  // step(), and in the same pass over memory writes each updated parameter,
  // rounded to nearest even, into a low-precision copy (e.g. the model's
  // bf16/fp16 weights). `lowp_copies` has one entry per parameter in
  // parameter-group order (group 0's parameters, then group 1's, ...); an
  // undefined entry means "no copy". A defined entry must be a contiguous CPU
  // tensor of dtype bfloat16 or float16 with the parameter's numel
  // (c10::TypeError / c10::ValueError otherwise). Parameters without a
  // gradient are not updated and their copies are not written. The copy is
  // bitwise equal to param.to(dtype) (NaN: canonical quiet NaN, as c10's
  // scalar conversions).
  void step_with_lowp_copy(const std::vector<torch::Tensor>& lowp_copies);

  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  // The name used in error messages ("Adam", "AdamW").
  explicit Adam(const char* name, std::vector<torch::optim::OptimizerParamGroup> param_groups,
                AdamOptions defaults);

 private:
  void run_step(const std::vector<torch::Tensor>* lowp_copies);

  const char* name_;
};

// Adam with decoupled weight decay. Every group given at construction, and the
// defaults used by later add_param_group() calls without options, get
// decoupled_weight_decay = true; other options are taken as given (so pass
// AdamWOptions, not AdamOptions, to keep AdamW's weight_decay default 1e-2).
class AdamW : public Adam {
 public:
  explicit AdamW(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                 AdamOptions defaults = AdamWOptions());
  explicit AdamW(std::vector<torch::Tensor> params, AdamOptions defaults = AdamWOptions());

  // As Adam::load; groups keep decoupled_weight_decay = true even when the
  // archive (e.g. one written by torch::optim::AdamW) does not say so.
  void load(torch::serialize::InputArchive& archive) override;
};

}  // namespace optim
}  // namespace roundpipe
