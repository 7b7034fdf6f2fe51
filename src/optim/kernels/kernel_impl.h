// The kernel loops, written once over an "Ops" vector abstraction and
// instantiated by each ISA file (scalar.cpp, avx2.cpp, avx512.cpp) with its own
// Ops and compiler flags.
//
// Everything here has internal linkage (an unnamed namespace) on purpose: each
// ISA file gets a private copy compiled with its own flags, so the linker can
// never pick an AVX-512-compiled copy of a shared inline function for the
// scalar path. For the same reason this file uses no std:: templates.
//
// Bitwise equality between ISAs: every path performs the same IEEE-754
// operations in the same order (add, mul, div, sqrt are correctly rounded in
// SSE/AVX and in scalar code alike; no FMA, the files are compiled with
// -ffp-contract=off). Vector loops handle whole vectors; the remainder goes
// through ScalarOps, which gives the same results element by element.
//
// An Ops type provides (V = one vector of kWidth floats):
//   load/store/set1, add/mul/div/sqrt, max(a, b) = a > b ? a : b, neg,
//   store_bf16/store_fp16 (c10's rounding), and a non-finite Flag accumulator.
#pragma once

#include <cstdint>
#include <cstring>

#include "optim/kernels/isa_kernels.h"

namespace roundpipe {
namespace optim {
namespace kernels {
namespace {  // NOLINT(build/namespaces_headers): see the comment at the top.

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// 2^112 and 2^-110: c10's fp16 rounding trick (see ScalarOps::fp16_bits).
constexpr float kScaleToInf = 0x1.0p+112f;
constexpr float kScaleToZero = 0x1.0p-110f;

struct ScalarOps {
  static constexpr int64_t kWidth = 1;
  using V = float;
  using Flag = bool;

  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V set1(float x) { return x; }
  static V add(V a, V b) { return a + b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return __builtin_sqrtf(a); }
  // The semantics of x86 MAXPS, so that all paths agree on NaN and -0.
  static V max(V a, V b) { return a > b ? a : b; }
  static V neg(V a) { return -a; }

  // c10::detail::round_to_nearest_even.
  static uint16_t bf16_bits(float f) {
    if (f != f) return 0x7FC0;
    const uint32_t u = float_bits(f);
    return static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
  }
  // c10::detail::fp16_ieee_from_fp32_value.
  static uint16_t fp16_bits(float f) {
    const float abs = bits_float(float_bits(f) & 0x7FFFFFFFu);
    float base = (abs * kScaleToInf) * kScaleToZero;
    const uint32_t w = float_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_float((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = float_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return static_cast<uint16_t>((sign >> 16) | (f != f ? 0x7E00u : nonsign));
  }
  static void store_bf16(uint16_t* dst, V v) { *dst = bf16_bits(v); }
  static void store_fp16(uint16_t* dst, V v) { *dst = fp16_bits(v); }

  static Flag flag_none() { return false; }
  static Flag flag_nonfinite(Flag f, V v) {
    return f || (float_bits(v) & 0x7F800000u) == 0x7F800000u;
  }
  static bool flag_any(Flag f) { return f; }
};

template <class Ops>
inline void store_lowp(uint16_t* dst, typename Ops::V v, LowpKind kind) {
  if (kind == LowpKind::kBFloat16) {
    Ops::store_bf16(dst, v);
  } else if (kind == LowpKind::kFloat16) {
    Ops::store_fp16(dst, v);
  }
}

// ---- Adam -------------------------------------------------------------------

template <class Ops>
struct AdamConsts {
  explicit AdamConsts(const AdamHyper& h)
      : beta1(Ops::set1(h.beta1)),
        one_minus_beta1(Ops::set1(h.one_minus_beta1)),
        beta2(Ops::set1(h.beta2)),
        one_minus_beta2(Ops::set1(h.one_minus_beta2)),
        weight_decay(Ops::set1(h.weight_decay)),
        decay_factor(Ops::set1(h.decay_factor)),
        bias_correction2_sqrt(Ops::set1(h.bias_correction2_sqrt)),
        eps(Ops::set1(h.eps)),
        neg_step_size(Ops::set1(h.neg_step_size)) {}
  typename Ops::V beta1, one_minus_beta1, beta2, one_minus_beta2, weight_decay, decay_factor,
      bias_correction2_sqrt, eps, neg_step_size;
};

template <class Ops>
inline void adam_at(const AdamHyper& h, const AdamConsts<Ops>& c, const AdamBuffers& b, int64_t i) {
  using V = typename Ops::V;
  V g = Ops::load(b.grad + i);
  if (h.maximize) g = Ops::neg(g);
  V p = Ops::load(b.param + i);
  if (h.coupled_weight_decay) g = Ops::add(g, Ops::mul(c.weight_decay, p));
  if (h.decoupled_weight_decay) p = Ops::mul(p, c.decay_factor);
  const V m = Ops::add(Ops::mul(Ops::load(b.exp_avg + i), c.beta1), Ops::mul(c.one_minus_beta1, g));
  V v = Ops::add(Ops::mul(Ops::load(b.exp_avg_sq + i), c.beta2),
                 Ops::mul(Ops::mul(c.one_minus_beta2, g), g));
  Ops::store(b.exp_avg + i, m);
  Ops::store(b.exp_avg_sq + i, v);
  if (h.amsgrad) {
    v = Ops::max(Ops::load(b.max_exp_avg_sq + i), v);
    Ops::store(b.max_exp_avg_sq + i, v);
  }
  const V denom = Ops::add(Ops::div(Ops::sqrt(v), c.bias_correction2_sqrt), c.eps);
  p = Ops::add(p, Ops::div(Ops::mul(c.neg_step_size, m), denom));
  Ops::store(b.param + i, p);
  if (b.lowp_kind != LowpKind::kNone) store_lowp<Ops>(b.lowp + i, p, b.lowp_kind);
}

template <class Ops>
void adam_range(const AdamHyper& hyper, const AdamBuffers& buffers, int64_t begin, int64_t end) {
  // Local copies: the compiler can keep them in registers across the stores.
  const AdamHyper h = hyper;
  const AdamBuffers b = buffers;
  int64_t i = begin;
  const AdamConsts<Ops> c(h);
  for (; i + Ops::kWidth <= end; i += Ops::kWidth) adam_at<Ops>(h, c, b, i);
  const AdamConsts<ScalarOps> cs(h);
  for (; i < end; ++i) adam_at<ScalarOps>(h, cs, b, i);
}

// ---- SGD --------------------------------------------------------------------

template <class Ops>
struct SgdConsts {
  explicit SgdConsts(const SgdHyper& h)
      : weight_decay(Ops::set1(h.weight_decay)),
        momentum(Ops::set1(h.momentum)),
        one_minus_dampening(Ops::set1(h.one_minus_dampening)),
        neg_lr(Ops::set1(h.neg_lr)) {}
  typename Ops::V weight_decay, momentum, one_minus_dampening, neg_lr;
};

template <class Ops>
inline void sgd_at(const SgdHyper& h, const SgdConsts<Ops>& c, const SgdBuffers& b, int64_t i) {
  using V = typename Ops::V;
  V g = Ops::load(b.grad + i);
  if (h.maximize) g = Ops::neg(g);
  V p = Ops::load(b.param + i);
  if (h.has_weight_decay) g = Ops::add(g, Ops::mul(c.weight_decay, p));
  if (h.has_momentum) {
    V buf = g;
    if (!h.first_step) {
      buf = Ops::add(Ops::mul(Ops::load(b.momentum_buffer + i), c.momentum),
                     Ops::mul(c.one_minus_dampening, g));
    }
    Ops::store(b.momentum_buffer + i, buf);
    g = h.nesterov ? Ops::add(g, Ops::mul(c.momentum, buf)) : buf;
  }
  p = Ops::add(p, Ops::mul(c.neg_lr, g));
  Ops::store(b.param + i, p);
  if (b.lowp_kind != LowpKind::kNone) store_lowp<Ops>(b.lowp + i, p, b.lowp_kind);
}

template <class Ops>
void sgd_range(const SgdHyper& hyper, const SgdBuffers& buffers, int64_t begin, int64_t end) {
  const SgdHyper h = hyper;
  const SgdBuffers b = buffers;
  int64_t i = begin;
  const SgdConsts<Ops> c(h);
  for (; i + Ops::kWidth <= end; i += Ops::kWidth) sgd_at<Ops>(h, c, b, i);
  const SgdConsts<ScalarOps> cs(h);
  for (; i < end; ++i) sgd_at<ScalarOps>(h, cs, b, i);
}

// ---- unscale + check, conversion ------------------------------------------

template <class Ops>
bool unscale_range(float* grad, int64_t begin, int64_t end, float inv_scale) {
  const bool scale = inv_scale != 1.0f;
  const typename Ops::V s = Ops::set1(inv_scale);
  typename Ops::Flag found = Ops::flag_none();
  int64_t i = begin;
  for (; i + Ops::kWidth <= end; i += Ops::kWidth) {
    const typename Ops::V x = Ops::load(grad + i);
    found = Ops::flag_nonfinite(found, x);
    if (scale) Ops::store(grad + i, Ops::mul(x, s));
  }
  bool found_tail = false;
  for (; i < end; ++i) {
    found_tail = ScalarOps::flag_nonfinite(found_tail, grad[i]);
    if (scale) grad[i] = grad[i] * inv_scale;
  }
  return Ops::flag_any(found) || found_tail;
}

template <class Ops>
void convert_range(const float* src, uint16_t* dst, int64_t begin, int64_t end, LowpKind kind) {
  int64_t i = begin;
  for (; i + Ops::kWidth <= end; i += Ops::kWidth)
    store_lowp<Ops>(dst + i, Ops::load(src + i), kind);
  for (; i < end; ++i) store_lowp<ScalarOps>(dst + i, src[i], kind);
}

template <class Ops>
constexpr detail::KernelTable make_table() {
  return detail::KernelTable{&adam_range<Ops>, &sgd_range<Ops>, &unscale_range<Ops>,
                             &convert_range<Ops>};
}

}  // namespace
}  // namespace kernels
}  // namespace optim
}  // namespace roundpipe
