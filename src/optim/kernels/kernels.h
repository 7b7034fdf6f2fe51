// CPU optimizer kernels: Adam/AdamW, SGD, gradient unscaling and fp32 ->
// bf16/fp16 conversion over plain float arrays, with explicit SIMD (scalar,
// AVX2+FMA, AVX-512) chosen at run time.
//
// This header is the only interface between the optimizers (and later the
// engine's optimizer thread) and the ISA-specific code. It names no torch
// type, so the ISA files can include it without pulling in any libtorch inline
// function compiled with AVX-512 flags.
//
// Numerics: every ISA path performs the same IEEE operations in the same order
// (no FMA contraction anywhere; the kernels are built with -ffp-contract=off),
// so all paths, and any split of the work between threads, give bitwise equal
// results. The operation order follows PyTorch's single-tensor Adam/SGD.
//
// ISA selection: the best ISA the CPU supports, unless the environment variable
// ROUNDPIPE_SIMD=scalar|avx2|avx512 forces one. It is read once, at the first
// kernel call, and again by select_isa_from_env().
//
// Threads: the entry points split the arrays at cache lines over libtorch's
// intra-op pool (at::get_num_threads() threads; arrays under 32K elements run
// on the caller). See parallel_ranges() in kernel_dispatch.cpp for why this is
// done through TensorIterator rather than a direct at::parallel_for.
//
// Thread-safety: the update functions are thread-safe for disjoint buffers.
// select_isa* may be called while other threads run kernels: each call uses
// one ISA throughout.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace roundpipe {
namespace optim {
namespace kernels {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Format of the optional low-precision copy written by the fused updates.
enum class LowpKind {
  kNone = 0,
  kBFloat16 = 1,  // round to nearest even, NaN -> 0x7FC0 (as c10::BFloat16)
  kFloat16 = 2,   // IEEE round to nearest even, NaN -> sign|0x7E00 (as c10::Half)
};

// Per-step constants of one Adam update, already rounded to float the way
// libtorch rounds its double scalars. Build with make_adam_hyper().
struct AdamHyper {
  float beta1 = 0;
  float one_minus_beta1 = 0;
  float beta2 = 0;
  float one_minus_beta2 = 0;
  float weight_decay = 0;           // coupled: g += weight_decay * p
  float decay_factor = 1;           // decoupled: p *= 1 - lr * weight_decay
  float bias_correction2_sqrt = 1;  // sqrt(1 - beta2^step)
  float eps = 0;
  float neg_step_size = 0;  // -lr / (1 - beta1^step)
  bool maximize = false;
  bool coupled_weight_decay = false;
  bool decoupled_weight_decay = false;
  bool amsgrad = false;
};

// `step` is the step number after increment (1 for the first update).
AdamHyper make_adam_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                          bool amsgrad, bool maximize, bool decoupled_weight_decay, int64_t step);

// The arrays of one Adam update; all of the same length n, not overlapping.
struct AdamBuffers {
  float* param = nullptr;           // [n] updated in place
  const float* grad = nullptr;      // [n] read only
  float* exp_avg = nullptr;         // [n] updated in place
  float* exp_avg_sq = nullptr;      // [n] updated in place
  float* max_exp_avg_sq = nullptr;  // [n] updated in place; only read when amsgrad
  uint16_t* lowp = nullptr;         // [n] receives the new param, or null
  LowpKind lowp_kind = LowpKind::kNone;
};

// Per-step constants of one SGD update. Build with make_sgd_hyper().
struct SgdHyper {
  float weight_decay = 0;
  float momentum = 0;
  float one_minus_dampening = 1;
  float neg_lr = 0;
  bool maximize = false;
  bool has_weight_decay = false;
  bool has_momentum = false;
  bool nesterov = false;
  bool first_step = false;  // momentum buffer starts as a copy of the gradient
};

SgdHyper make_sgd_hyper(double lr, double momentum, double dampening, double weight_decay,
                        bool nesterov, bool maximize, bool first_step);

struct SgdBuffers {
  float* param = nullptr;            // [n] updated in place
  const float* grad = nullptr;       // [n] read only
  float* momentum_buffer = nullptr;  // [n] when momentum != 0; written, read unless first_step
  uint16_t* lowp = nullptr;          // [n] receives the new param, or null
  LowpKind lowp_kind = LowpKind::kNone;
};

// One pass over n elements:
//   g = maximize ? -grad : grad;  if coupled: g = g + wd * p
//   if decoupled: p = p * (1 - lr * wd)
//   m = m * b1 + (1 - b1) * g;    v = v * b2 + ((1 - b2) * g) * g
//   if amsgrad: max_v = max(max_v, v) (NaN in v propagates)
//   denom = sqrt(amsgrad ? max_v : v) / sqrt(bc2) + eps
//   p = p + (-step_size * m) / denom;  lowp = round(p)
// Multithreaded (see the top of this file); bitwise independent of the split.
void adam_update(const AdamHyper& hyper, const AdamBuffers& buffers, int64_t n);

// One pass over n elements:
//   g = maximize ? -grad : grad;  if weight_decay: g = g + wd * p
//   if momentum: buf = first_step ? g : buf * momentum + (1 - dampening) * g
//                g = nesterov ? g + momentum * buf : buf
//   p = p + (-lr) * g;  lowp = round(p)
void sgd_update(const SgdHyper& hyper, const SgdBuffers& buffers, int64_t n);

// grad *= inv_scale in one pass (skipped when inv_scale == 1) and returns
// whether any element of the *input* was inf or NaN, like
// torch._amp_foreach_non_finite_check_and_unscale_ (elements are scaled even
// when a non-finite one is found).
bool unscale_and_check(float* grad, int64_t n, float inv_scale);

// dst = round(src) to `kind` (not kNone), bitwise like Tensor::to().
void convert_to_lowp(const float* src, uint16_t* dst, int64_t n, LowpKind kind);

// ---- ISA selection ---------------------------------------------------------

const char* isa_name(Isa isa);  // "scalar", "avx2", "avx512"

// Whether this build and this CPU (and the OS) can run `isa`.
bool isa_supported(Isa isa);

// The best supported ISA.
Isa best_isa();

// The ISA the kernels use now (selecting it from the environment if no
// selection was made yet).
Isa active_isa();

// Makes the kernels use `isa`. Throws c10::ValueError if it is unsupported.
void select_isa(Isa isa);

// Parses "scalar"|"avx2"|"avx512" (or "" = best) and selects it. Throws
// c10::ValueError on an unknown name or an unsupported ISA.
Isa select_isa(const std::string& name);

// Re-reads ROUNDPIPE_SIMD and selects accordingly (unset or empty = best).
Isa select_isa_from_env();

// Testing hook: how the update functions split n elements between threads
// (sorted [begin, end) chunks) and how many distinct threads ran them.
struct ChunksForTesting {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  int num_threads = 0;
};
ChunksForTesting chunks_for_testing(int64_t n);

// Testing hook: pretend the CPU supports nothing above `max_isa`.
void set_max_isa_for_testing(Isa max_isa);

}  // namespace kernels
}  // namespace optim
}  // namespace roundpipe
