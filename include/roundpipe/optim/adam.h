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
// Parameters: float32 or bfloat16, contiguous, dense (strided), CPU tensors;
// their gradients likewise, float32 for a float32 parameter, bfloat16 or
// float32 for a bfloat16 one. Anything else (float16, float64, complex, ...)
// throws at construction (for the parameters given then) or at step() (for
// parameters added later, gradients and loaded state): c10::TypeError for a
// wrong dtype, layout or device, c10::ValueError for a non-contiguous or
// undefined tensor or a size mismatch. The message names the parameter by its
// index over all parameter groups (and its group and position). step() checks
// everything before it modifies anything. Parameters whose .grad() is
// undefined are skipped, as in libtorch.
//
// bfloat16 parameters are their own optimizer copy: 2 bytes per element
// instead of 4, and no compensation term. Each step widens the parameter to
// fp32, runs the fp32 update below with the group's states (any state_dtype,
// amsgrad too) and stores it rounded stochastically (kernels.h,
// ParamFormat::kBFloat16Stochastic), so that updates far below half a bf16
// ulp still move it on average. The rounding is seeded by
//   sr_seed = the parameter's index over all parameter groups,
//   sr_step = the step number of the update (state.step() after it is
//             incremented: 1 for the first update),  sr_offset = 0,
// so it is independent of the SIMD path and thread count, two runs on the
// same inputs are bitwise equal, and a run resumed from an archive (which
// restores step) continues bitwise as long as the parameter order is kept.
// step_with_lowp_copy() takes no copy for a bfloat16 parameter.
//
// State: roundpipe::optim::AdamParamState per parameter (libtorch's
// torch::optim::AdamParamState: step, exp_avg, exp_avg_sq, max_exp_avg_sq when
// amsgrad; plus the block scales of 8-bit states), in Optimizer::state() under
// the same key libtorch uses, so save()/load() archives have libtorch's layout
// (plus two option keys, maximize and decoupled_weight_decay, which loading
// treats as false when absent). An archive written by torch::optim::Adam can be
// loaded. Not the other way round for compact states: torch::optim::Adam
// takes a compact-state archive's bf16 tensors or uint8 codes as they are.
//
// Compact states: AdamOptions::state_dtype stores the moment estimates
// (exp_avg, exp_avg_sq, max_exp_avg_sq) in fewer bytes. Per parameter element:
//   StateDtype::kFloat32     8 bytes (12 with amsgrad); the default, and the
//                            results above.
//   StateDtype::kBFloat16    4 bytes (6 with amsgrad): bf16 tensors, rounded
//                            to nearest even after every update.
//   StateDtype::kBlockwise8  2 bytes + 2 floats per 256 elements (2.03125
//                            bytes): bitsandbytes-style blockwise 8-bit
//                            quantization (kernels.h, StateFormat). No amsgrad.
// Each step widens the states to fp32, runs the fp32 update above (the new
// parameter uses the unrounded fp32 moments) and narrows them again, in one
// fused pass. (The parameter itself adds 4 bytes per element as float32, 2
// as bfloat16.) In the state and in archives, per format:
//   fp32:   exp_avg, exp_avg_sq [, max_exp_avg_sq]  float32, the parameter's sizes
//   bf16:   the same keys, bfloat16
//   8-bit:  exp_avg, exp_avg_sq  uint8 codes, the parameter's sizes (index into
//           the signed map for exp_avg, the unsigned map for exp_avg_sq);
//           exp_avg_absmax, exp_avg_sq_absmax  float32 [ceil(numel / 256)], the
//           scale of each block of 256 elements (in row-major order)
// The format of a stored state is read from these dtypes. A state in another
// format than the parameter's group asks for (loaded from an archive, or after
// state_dtype was changed) is converted when loaded and at step(): bf16 by
// rounding to nearest even, 8-bit by quantizing (the nearest map entry after
// dividing by the block's absmax), fp32 exactly; max_exp_avg_sq is dropped
// when converting to 8-bit. Parameters with fewer than kMinBlockwise8Numel
// elements keep fp32 states when 8-bit is asked (the savings would be small
// and the quantization error of tiny tensors, e.g. biases and norms, large).
//
// Thread-safety: thread-compatible, like torch::optim::Optimizer: one thread
// at a time may call a method; step() itself uses libtorch's intra-op pool.
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

namespace roundpipe {
namespace optim {

// How Adam stores its moment estimates (see the top of this file).
enum class StateDtype {
  kFloat32 = 0,
  kBFloat16 = 1,
  kBlockwise8 = 2,
};

// "float32", "bfloat16", "blockwise8".
const char* state_dtype_name(StateDtype dtype);

// Parameters with fewer elements keep fp32 states under StateDtype::kBlockwise8
// (bitsandbytes' min_8bit_size).
constexpr int64_t kMinBlockwise8Numel = 4096;

// State of one parameter: libtorch's, plus the block scales of 8-bit states
// (undefined for fp32 and bf16 states).
struct AdamParamState : public torch::optim::AdamParamState {
  TORCH_ARG(torch::Tensor, exp_avg_absmax);
  TORCH_ARG(torch::Tensor, exp_avg_sq_absmax);

 public:
  std::unique_ptr<torch::optim::OptimizerParamState> clone() const override;
  // Absent keys (archives of fp32 states) leave the member undefined.
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

// Options of Adam, with libtorch's names and defaults plus those of
// torch.optim.Adam that libtorch 1.13 lacks. Validated when an optimizer is
// constructed (defaults and every group given) and at every step() (every
// group): c10::ValueError unless lr >= 0, 0 <= beta1 < 1, 0 <= beta2 < 1,
// eps >= 0 and weight_decay >= 0 (NaN fails all of these), and not amsgrad
// with StateDtype::kBlockwise8.
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
  // Storage of exp_avg/exp_avg_sq/max_exp_avg_sq (see the top of this file).
  // Default kFloat32. kBlockwise8 with amsgrad is a c10::ValueError. Not saved
  // in archives: load() keeps each group's own state_dtype and converts the
  // loaded states to it.
  TORCH_ARG(StateDtype, state_dtype) = StateDtype::kFloat32;

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
  // (c10::TypeError / c10::ValueError otherwise); undefined for a bfloat16
  // parameter, which is its own copy (c10::ValueError). Parameters without a
  // gradient are not updated and their copies are not written. The copy is
  // bitwise equal to param.to(dtype) (NaN: canonical quiet NaN, as c10's
  // scalar conversions).
  void step_with_lowp_copy(const std::vector<torch::Tensor>& lowp_copies);

  void save(torch::serialize::OutputArchive& archive) const override;
  // Also converts the loaded states to each group's state_dtype (see the top
  // of this file). A state of the wrong size or dtype is a c10::ValueError /
  // c10::TypeError naming the parameter and the tensor, and leaves the
  // optimizer as it was.
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
