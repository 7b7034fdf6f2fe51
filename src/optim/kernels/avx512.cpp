// The AVX-512 kernels (16 floats per vector). Compiled with -mavx512f
// -mavx512bw -mavx2 -mfma -ffp-contract=off; uses AVX-512F instructions only
// and is called only after the dispatcher checked the CPU.
#include "optim/kernels/isa_kernels.h"

#if defined(__x86_64__) && defined(__AVX512F__)

// GCC 12 flags the deliberately undefined pass-through operand of the unmasked
// AVX-512 intrinsics (_mm512_undefined_*) as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include "optim/kernels/kernel_impl.h"

namespace roundpipe {
namespace optim {
namespace kernels {
namespace {

inline __m512i splat(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }

struct Avx512Ops {
  static constexpr int64_t kWidth = 16;
  using V = __m512;
  using Flag = __mmask16;  // lanes where a non-finite value was seen

  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  // Integer xor: the float form needs AVX512DQ.
  static V neg(V a) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), splat(0x80000000u)));
  }

  static void store_u16(uint16_t* dst, __m512i x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(x));
  }
  static __mmask16 nan_mask(V v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }

  // Lane-wise ScalarOps::bf16_bits.
  static void store_bf16(uint16_t* dst, V v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), splat(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, splat(0x7FFF))), 16);
    store_u16(dst, _mm512_mask_blend_epi32(nan_mask(v), rounded, splat(0x7FC0)));
  }

  // Lane-wise ScalarOps::fp16_bits.
  static void store_fp16(uint16_t* dst, V v) {
    const __m512i w = _mm512_castps_si512(v);
    const V abs = _mm512_castsi512_ps(_mm512_and_si512(w, splat(0x7FFFFFFFu)));
    V base = _mm512_mul_ps(_mm512_mul_ps(abs, set1(kScaleToInf)), set1(kScaleToZero));
    const __m512i shl1_w = _mm512_add_epi32(w, w);
    const __m512i sign = _mm512_and_si512(w, splat(0x80000000u));
    const __m512i bias =
        _mm512_max_epu32(_mm512_and_si512(shl1_w, splat(0xFF000000u)), splat(0x71000000u));
    base = _mm512_add_ps(
        _mm512_castsi512_ps(_mm512_add_epi32(_mm512_srli_epi32(bias, 1), splat(0x07800000u))),
        base);
    const __m512i bits = _mm512_castps_si512(base);
    const __m512i exp_bits = _mm512_and_si512(_mm512_srli_epi32(bits, 13), splat(0x7C00u));
    const __m512i mantissa_bits = _mm512_and_si512(bits, splat(0xFFFu));
    const __m512i nonsign = _mm512_add_epi32(exp_bits, mantissa_bits);
    store_u16(dst, _mm512_or_si512(_mm512_srli_epi32(sign, 16),
                                   _mm512_mask_blend_epi32(nan_mask(v), nonsign, splat(0x7E00u))));
  }

  static Flag flag_none() { return 0; }
  static Flag flag_nonfinite(Flag f, V v) {
    const __m512i exponent = _mm512_and_si512(_mm512_castps_si512(v), splat(0x7F800000u));
    return static_cast<Flag>(f | _mm512_cmpeq_epi32_mask(exponent, splat(0x7F800000u)));
  }
  static bool flag_any(Flag f) { return f != 0; }
};

constexpr detail::KernelTable kAvx512Table = make_table<Avx512Ops>();

}  // namespace

namespace detail {
const KernelTable* avx512_kernels() { return &kAvx512Table; }
}  // namespace detail

}  // namespace kernels
}  // namespace optim
}  // namespace roundpipe

#else  // not built for x86 with AVX-512 flags

namespace roundpipe {
namespace optim {
namespace kernels {
namespace detail {
const KernelTable* avx512_kernels() { return nullptr; }
}  // namespace detail
}  // namespace kernels
}  // namespace optim
}  // namespace roundpipe

#endif
