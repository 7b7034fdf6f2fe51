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
// Threads: the entry points split the arrays at cache lines (the compact-state
// ones at quantization blocks) over libtorch's intra-op pool
// (at::get_num_threads() threads; arrays under 32K elements run on the caller). See
// parallel_ranges() in kernel_dispatch.cpp for why this is done through TensorIterator rather than
// a direct at::parallel_for.
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

// ---- Adam with compact states -----------------------------------------------
//
// adam_update_compact() runs the Adam/AdamW math of adam_update() (the same
// fp32 operations in the same order) on states and a parameter kept in
// smaller formats: each element's states are widened to fp32, updated, and
// narrowed again in the same pass. The update itself uses the fp32 values
// before narrowing, so only what is carried to the next step is rounded.

// Storage of exp_avg, exp_avg_sq (and max_exp_avg_sq) between steps.
enum class StateFormat {
  kFp32 = 0,
  // bf16 bits; stored rounded to nearest even (as kBFloat16 copies are).
  kBFloat16 = 1,
  // 8-bit blockwise quantization, as bitsandbytes' blockwise 8-bit Adam:
  // blocks of kBlockwise8BlockSize elements, one uint8 code per element and
  // one float absmax per block; the value is map[code] * absmax, exp_avg with
  // the signed map, exp_avg_sq with the unsigned one (blockwise8_map()).
  // After the update, a block's new absmax is max |value| over the block and
  // each code is the nearest map entry to value / absmax (ties to the lower
  // code), except that exp_avg_sq's code 0 (the entry 0) is for 0 alone: a
  // positive value under the map's smallest positive entry (3.25e-7) gets
  // that entry. Rounded to 0, a small exp_avg_sq beside a nonzero exp_avg
  // would turn the update into exp_avg / eps, up to 1e5 times lr; the floor
  // only shrinks such updates. An inf or NaN in a block makes the whole
  // block's states non-finite.
  // No amsgrad.
  kBlockwise8 = 2,
};

// Storage of the parameter.
enum class ParamFormat {
  kFp32 = 0,  // float, updated in place; an optional lowp copy as in AdamBuffers
  // The parameter exists only as bf16 bits: it is widened, updated in fp32 and
  // stored rounded stochastically (see CompactAdamBuffers::sr_seed), so that
  // updates far below a bf16 ulp still move it on average.
  kBFloat16Stochastic = 1,
};

// Elements per quantization block. A power of two, a multiple of every
// vector width and of a cache line of floats, bf16 and codes: threads split
// the arrays at block boundaries, so a block never straddles two threads.
constexpr int64_t kBlockwise8BlockSize = 256;

inline int64_t blockwise8_num_blocks(int64_t n) {
  return (n + kBlockwise8BlockSize - 1) / kBlockwise8BlockSize;
}

// The 256 values of a blockwise-8 map, ascending, in [-1, 1] (signed) or
// [0, 1] (unsigned); both contain 0 and 1. bitsandbytes' "dynamic" map
// (create_dynamic_map with 7 exponent bits): after the sign bit (signed map
// only), a run of e zero bits (e = 0..6) selects the decade 10^-e, a one bit
// ends the run and the remaining f bits (f = 6 - e signed, 7 - e unsigned)
// are a linear fraction: the value is
//   10^-e * (0.1 + 0.9 * (2 j + 1) / 2^(f + 1)),  j = 0 .. 2^f - 1,
// i.e. the midpoints of 2^f equal steps of [0.1, 1] (computed in double,
// rounded once to float). The signed map has these 127 values, their
// negatives, 0 and 1; the unsigned map 254 values, 0 and 1. The codes index
// the sorted map, so they are not bitsandbytes' bit patterns; the values
// are within 2 float ulps of bitsandbytes' (which computes them in float).
const float* blockwise8_map(bool is_signed);

// One state array in a StateFormat; only the members of its format are used.
struct CompactState {
  float* fp32 = nullptr;     // [n] kFp32
  uint16_t* bf16 = nullptr;  // [n] kBFloat16
  uint8_t* codes = nullptr;  // [n] kBlockwise8
  float* absmax = nullptr;   // [blockwise8_num_blocks(n)] kBlockwise8
};

// The arrays of one compact Adam update; all of the same length n, not
// overlapping.
struct CompactAdamBuffers {
  StateFormat state_format = StateFormat::kFp32;
  ParamFormat param_format = ParamFormat::kFp32;
  const float* grad = nullptr;  // [n] read only; unused when grad_bf16 is set
  // [n] bf16 bits, read only: the gradient of a bf16 model, used instead of
  // `grad` when non-null. Widened exactly (bits << 16) in the same pass, so
  // the result is bitwise that of passing the widened fp32 array as `grad`.
  const uint16_t* grad_bf16 = nullptr;
  float* param = nullptr;          // [n] kFp32: updated in place
  uint16_t* param_bf16 = nullptr;  // [n] kBFloat16Stochastic: bf16 bits, updated in place
  uint16_t* lowp = nullptr;        // [n] kFp32 param only: receives the new param, or null
  LowpKind lowp_kind = LowpKind::kNone;
  CompactState exp_avg;         // updated in place
  CompactState exp_avg_sq;      // updated in place
  CompactState max_exp_avg_sq;  // updated in place; only read when amsgrad
  // Stochastic rounding of param_bf16: element i is stored as
  //   bf16 bits = (fp32 bits + (r >> 16)) >> 16   (NaN -> 0x7FC0)
  // which rounds the magnitude up with probability (dropped bits) / 2^16.
  // r is a counter-based hash, so the result does not depend on the split
  // between threads or on the ISA:
  //   key = splitmix64(splitmix64(sr_seed) ^ sr_step)
  //   j = sr_offset + i (64 bits), lo/hi its 32-bit halves, k0/k1 the key's
  //   r = lowbias32(lowbias32(lo ^ k0) ^ hi ^ k1)
  // with lowbias32(x): x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15;
  // x *= 0x846CA68B; x ^= x >> 16 (32-bit wrapping products), and
  // splitmix64(x): x += 0x9E3779B97F4A7C15; x = (x ^ (x >> 30)) *
  // 0xBF58476D1CE4E5B9; x = (x ^ (x >> 27)) * 0x94D049BB133111EB;
  // x ^ (x >> 31) (64-bit wrapping). A parameter updated in several pieces
  // passes each piece's position as sr_offset; sr_step is usually the step.
  uint64_t sr_seed = 0;
  uint64_t sr_step = 0;
  int64_t sr_offset = 0;
};

// One Adam pass over n elements in the formats of `buffers` (see above).
// Multithreaded at block boundaries; bitwise independent of the split and of
// the ISA.
void adam_update_compact(const AdamHyper& hyper, const CompactAdamBuffers& buffers, int64_t n);

// Blockwise-8 conversion of whole arrays, bitwise as adam_update_compact
// narrows and widens its states: codes[n] and absmax[blockwise8_num_blocks(n)]
// from src[n], and back.
void blockwise8_quantize(const float* src, uint8_t* codes, float* absmax, int64_t n,
                         bool is_signed);
void blockwise8_dequantize(const uint8_t* codes, const float* absmax, float* dst, int64_t n,
                           bool is_signed);

// ---- bf16 sums ----------------------------------------------------------------
//
// acc[i] <- widen(acc[i]) + x[i] in fp32, stored in bf16 with the stochastic
// rounding of CompactAdamBuffers (key = splitmix64(splitmix64(seed) ^ step),
// element j = i), so that adding many small bf16 terms keeps their sum on
// average. Exactly one of x_bf16 / x_fp32 is non-null. Scalar code on the
// caller's thread: every ISA gives the same bits.
void add_bf16_stochastic(uint16_t* acc, const uint16_t* x_bf16, const float* x_fp32, int64_t n,
                         uint64_t seed, uint64_t step);

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
