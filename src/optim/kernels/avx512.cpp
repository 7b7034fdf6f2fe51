// The AVX-512 kernels (16 floats per vector). Compiled with -mavx512f
// -mavx512bw -mavx2 -mfma -ffp-contract=off; uses AVX-512F instructions only
// and is called only after the dispatcher checked the CPU.
#include "optim/kernels/isa_kernels.h"

#if defined(__x86_64__) && defined(__AVX512F__)

// GCC 12 flags the deliberately undefined pass-through operand of the unmasked
// AVX-512 intrinsics (_mm512_undefined_*) as maybe-uninitialized, or, once
// inlined into a larger function, as uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <immintrin.h>

#include "optim/kernels/kernel_impl.h"

namespace roundpipe {
namespace optim {
namespace kernels {
namespace {

inline __m512i splat(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }

struct Avx512Ops {
  static constexpr int64_t kWidth = 16;
  static constexpr bool kDirectCodes = true;
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

  static V load_bf16(const uint16_t* p) {
    const __m512i u =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }

  static __m512i lowbias32(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, splat(0x7FEB352Du));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, splat(0x846CA68Bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }

  // Lane-wise ScalarOps::bf16_stochastic_bits for elements j .. j + 15.
  static void store_bf16_stochastic(uint16_t* dst, V v, uint64_t j, uint64_t key) {
    const __m512i lo0 = splat(static_cast<uint32_t>(j));
    const __m512i lo = _mm512_add_epi32(
        lo0, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __mmask16 carry = _mm512_cmplt_epu32_mask(lo, lo0);
    const __m512i hi0 = splat(static_cast<uint32_t>(j >> 32));
    const __m512i hi = _mm512_mask_add_epi32(hi0, carry, hi0, splat(1));
    __m512i h = lowbias32(_mm512_xor_si512(lo, splat(static_cast<uint32_t>(key))));
    h = lowbias32(
        _mm512_xor_si512(_mm512_xor_si512(h, hi), splat(static_cast<uint32_t>(key >> 32))));
    const __m512i u = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_srli_epi32(h, 16)), 16);
    store_u16(dst, _mm512_mask_blend_epi32(nan_mask(v), rounded, splat(0x7FC0)));
  }

  // The blockwise-8 tables are read with in-register permutes rather than
  // gathers, which cost far more per lane (and much more again on CPUs with
  // the gather microcode mitigations). table[idx] for a 64-byte aligned
  // table of 32 << k entries, idx in range: two-source permutes of 32
  // entries, chosen by bits 5, 6, 7 of idx (bits above are ignored).
  static V permute32(const float* table, __m512i idx) {
    return _mm512_permutex2var_ps(_mm512_load_ps(table), idx, _mm512_load_ps(table + 16));
  }
  static V permute64(const float* table, __m512i idx) {
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, splat(32)), permute32(table, idx),
                                permute32(table + 32, idx));
  }
  static V permute128(const float* table, __m512i idx) {
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, splat(64)), permute64(table, idx),
                                permute64(table + 64, idx));
  }
  static V permute256(const float* table, __m512i idx) {
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, splat(128)), permute128(table, idx),
                                permute128(table + 128, idx));
  }

  static V lookup(const float* table, const uint8_t* codes) {
    const __m512i idx =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    return permute256(table, idx);
  }

  // One step of ScalarOps::nearest_code: node = 2 node + (t < y).
  static __m512i descend(__m512i node, V t, V y) {
    const __mmask16 below = _mm512_cmp_ps_mask(t, y, _CMP_LT_OQ);
    const __m512i twice = _mm512_add_epi32(node, node);
    return _mm512_mask_add_epi32(twice, below, twice, splat(1));
  }

  // Lane-wise ScalarOps::nearest_code. The nodes of depth d are
  // [2^d, 2^(d+1)), so the low bits of node index that depth's slice of the
  // heap: search[0..15] serves depths 0-3, then slices of 16, 32, 64, 128.
  static void store_codes(uint8_t* dst, V y, const float* search) {
    const V top = _mm512_load_ps(search);
    __m512i node = splat(1);
    for (int depth = 0; depth < 4; ++depth) {
      node = descend(node, _mm512_permutexvar_ps(node, top), y);
    }
    node = descend(node, _mm512_permutexvar_ps(node, _mm512_load_ps(search + 16)), y);
    node = descend(node, permute32(search + 32, node), y);
    node = descend(node, permute64(search + 64, node), y);
    node = descend(node, permute128(search + 128, node), y);
    // node = 256 + code: the truncating narrowing keeps the code.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(node));
  }

  // How close (in units of the spacing of a decade's entries) y may come to
  // a midpoint inside a decade, and how many float steps to a cross
  // midpoint, before store_codes_direct leaves the vector to the search. y is
  // the value times the rounded reciprocal of the divisor, within 2 float
  // steps of the exact quotient; with the rounding of the tables that moves
  // the position by under 2^-12 of a spacing (the exhaustive tests check the
  // margin).
  static constexpr float kNearMidpoint = 0x1.0p-10f;
  static constexpr uint32_t kNearCross = 64;

  // The codes of y (16 lanes) from Blockwise8Direct without a search, as
  // ScalarOps::nearest_code gives them for the exact quotient. Returns false,
  // storing nothing, when some lane lies so close to a midpoint that the
  // approximate y might fall on the other side of it than the exact one.
  template <bool kSigned>
  static bool store_codes_direct(uint8_t* dst, V y, const Blockwise8Direct& t) {
    const __m512i bits = _mm512_castps_si512(y);
    const __mmask16 negative = _mm512_test_epi32_mask(bits, splat(0x80000000u));
    // |y|, at most just above 1: NaN, inf and anything above 1 land in the
    // binade of 1 (NaN lanes are replaced below).
    const __m512i abs =
        _mm512_min_epu32(_mm512_and_si512(bits, splat(0x7FFFFFFFu)), splat(0x3F800001u));
    // The binade, 0 for everything below 2^-30 (saturating subtraction).
    const __m512i binade = _mm512_subs_epu16(_mm512_srli_epi32(abs, 23), splat(127 - 31));
    const V cross =
        _mm512_permutex2var_ps(_mm512_load_ps(t.cross), binade, _mm512_load_ps(t.cross + 16));
    const __m512i below = _mm512_permutex2var_epi32(_mm512_load_si512(t.decade_below), binade,
                                                    _mm512_load_si512(t.decade_below + 16));
    const V a = _mm512_castsi512_ps(abs);
    const __m512i decade =
        _mm512_mask_add_epi32(below, _mm512_cmp_ps_mask(cross, a, _CMP_LT_OQ), below, splat(1));
    const V pos =
        _mm512_add_ps(_mm512_mul_ps(a, _mm512_permutexvar_ps(decade, _mm512_load_ps(t.scale))),
                      _mm512_permutexvar_ps(decade, _mm512_load_ps(t.offset)));
    // pos > 0 in every lane, so truncation is the floor.
    const __m512i floor = _mm512_cvttps_epi32(pos);
    const V frac = _mm512_sub_ps(pos, _mm512_cvtepi32_ps(floor));
    // |abs - cross| < kNearCross as one unsigned comparison.
    const __m512i to_cross =
        _mm512_add_epi32(_mm512_sub_epi32(abs, _mm512_castps_si512(cross)), splat(kNearCross));
    const __mmask16 near = _mm512_cmp_ps_mask(frac, set1(kNearMidpoint), _CMP_LT_OQ) |
                           _mm512_cmp_ps_mask(frac, set1(1.0f - kNearMidpoint), _CMP_GT_OQ) |
                           _mm512_cmplt_epu32_mask(to_cross, splat(2 * kNearCross));
    if (near != 0) return false;
    const __m512i k =
        _mm512_min_epi32(floor, _mm512_permutexvar_epi32(decade, _mm512_load_si512(t.last)));
    __m512i code;
    if (kSigned) {
      // Negative y: 127 - k, where the side has no -1 (k = 128 is code 0 too).
      const __m512i k_neg = _mm512_min_epi32(k, splat(127));
      code = _mm512_mask_sub_epi32(_mm512_add_epi32(k, splat(127)), negative, splat(127), k_neg);
    } else {
      // Negative y is below every midpoint of the unsigned map: code 0.
      code = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~negative), k);
    }
    code = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~nan_mask(y)), code);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(code));
    return true;
  }

  using AbsBits = __m512i;
  static AbsBits absbits_none() { return _mm512_setzero_si512(); }
  static AbsBits absbits_max(AbsBits acc, V v) {
    return _mm512_max_epu32(acc, _mm512_and_si512(_mm512_castps_si512(v), splat(0x7FFFFFFFu)));
  }
  static uint32_t absbits_reduce(AbsBits acc) { return _mm512_reduce_max_epu32(acc); }
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
