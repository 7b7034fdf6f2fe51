// The AVX-512 kernels (16 floats per vector). Compiled with -mavx512f
// -mavx512bw -mavx2 -mfma -ffp-contract=off and called only after the
// dispatcher checked the CPU; the blockwise-8 lookups use AVX512-VBMI byte
// permutes where the CPU has them (one table with, one without).
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

// The byte order of 64 codes that makes the byte-to-float interleave below
// (unpacks within 128-bit lanes) write elements in order: position
// 16 L + 4 k + j (lane L, quarter k) holds element 16 k + 4 L + j.
struct CodeOrder {
  alignas(64) uint8_t index[64];
};
constexpr CodeOrder make_code_order() {
  CodeOrder o{};
  for (int lane = 0; lane < 4; ++lane) {
    for (int k = 0; k < 4; ++k) {
      for (int j = 0; j < 4; ++j)
        o.index[16 * lane + 4 * k + j] = static_cast<uint8_t>(16 * k + 4 * lane + j);
    }
  }
  return o;
}
constexpr CodeOrder kCodeOrder = make_code_order();

// out[i] = map.values[codes[i]] * absmax for whole runs of 64 codes; returns
// how many. Each byte of the 64 floats is looked up in its plane of the map
// (value_bytes) by two 128-entry byte permutes, chosen by the code's top
// bit; the four planes are then interleaved into floats. A separate function
// with its own target: called only where the CPU has AVX512-VBMI.
__attribute__((target("avx512vbmi"), noinline)) int64_t dequantize_codes_vbmi(
    const Blockwise8Map& map, const uint8_t* codes, float absmax, float* out, int64_t len) {
  const __m512i order = _mm512_load_si512(kCodeOrder.index);
  const __m512 a = _mm512_set1_ps(absmax);
  int64_t i = 0;
  for (; i + 64 <= len; i += 64) {
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + i));
    const __mmask64 high = _mm512_movepi8_mask(c);
    __m512i plane[4];
    for (int b = 0; b < 4; ++b) {
      const uint8_t* t = map.value_bytes[b];
      const __m512i low_half =
          _mm512_permutex2var_epi8(_mm512_load_si512(t), c, _mm512_load_si512(t + 64));
      const __m512i high_half =
          _mm512_permutex2var_epi8(_mm512_load_si512(t + 128), c, _mm512_load_si512(t + 192));
      plane[b] = _mm512_mask_blend_epi8(high, low_half, high_half);
    }
    const __m512i lo01 = _mm512_unpacklo_epi8(plane[0], plane[1]);
    const __m512i hi01 = _mm512_unpackhi_epi8(plane[0], plane[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(plane[2], plane[3]);
    const __m512i hi23 = _mm512_unpackhi_epi8(plane[2], plane[3]);
    const __m512i floats[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                               _mm512_unpacklo_epi16(hi01, hi23),
                               _mm512_unpackhi_epi16(hi01, hi23)};
    for (int k = 0; k < 4; ++k) {
      _mm512_storeu_ps(out + i + 16 * k, _mm512_mul_ps(_mm512_castsi512_ps(floats[k]), a));
    }
  }
  return i;
}

// kByteLookup: dequantize with dequantize_codes_vbmi (CPUs with AVX512-VBMI).
template <bool kByteLookup>
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
  static int64_t dequantize_codes(const Blockwise8Map& map, const uint8_t* codes, float absmax,
                                  float* out, int64_t len) {
    if constexpr (kByteLookup) return dequantize_codes_vbmi(map, codes, absmax, out, len);
    return 0;
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

  // The codes of y (16 lanes) by Blockwise8Direct (see kernel_impl.h), as
  // ScalarOps::nearest_code gives them for the exact quotient, when y is the
  // value times the rounded reciprocal of the divisor: within 2 float steps
  // of the exact quotient, which moves the position by under 2^-13 of an
  // entry spacing (the rounding of the tables included), far less than the
  // 2^-10 and kDirectNearCross steps that make a lane near a midpoint.
  // Returns false, storing nothing, when some lane is near one: the approximate
  // y might fall on the other side of it than the exact one (or tie with it).
  // The position is formed with an FMA; it only picks the code, and the
  // margins cover its rounding either way.
  template <bool kSigned>
  static bool store_codes_direct(uint8_t* dst, V y, const Blockwise8Direct& t) {
    const __m512i bits = _mm512_castps_si512(y);
    // Unsigned: negative y (sign bit set) clamps to the marked binade 31.
    const __m512i magnitude = kSigned ? _mm512_and_si512(bits, splat(0x7FFFFFFFu)) : bits;
    const __m512i abs = _mm512_max_epu32(_mm512_min_epu32(magnitude, splat(kDirectClampBits)),
                                         splat(kDirectMinBits));
    // Binade b in the exponent's low 5 bits (exponents 96 .. 127); the
    // permutes read only those.
    const __m512i binade = _mm512_srli_epi32(abs, 23);
    const __m512i to_cross =
        _mm512_sub_epi32(abs, _mm512_permutex2var_epi32(_mm512_load_si512(t.cross_near), binade,
                                                        _mm512_load_si512(t.cross_near + 16)));
    const __m512i below = _mm512_permutex2var_epi32(_mm512_load_si512(t.decade_below), binade,
                                                    _mm512_load_si512(t.decade_below + 16));
    const __mmask16 above = _mm512_cmpgt_epi32_mask(to_cross, splat(kDirectNearCross));
    const __m512i decade = _mm512_mask_add_epi32(below, above, below, splat(1));
    const V pos = _mm512_fmadd_ps(_mm512_castsi512_ps(abs),
                                  _mm512_permutexvar_ps(decade, _mm512_load_ps(t.scale)),
                                  _mm512_permutexvar_ps(decade, _mm512_load_ps(t.offset)));
    const __m512i grid = _mm512_castps_si512(_mm512_add_ps(pos, set1(kDirectGrid)));
    const __mmask16 near = _mm512_cmplt_epu32_mask(to_cross, splat(2 * kDirectNearCross)) |
                           _mm512_testn_epi32_mask(grid, splat(0x1FF));
    if (near != 0) return false;
    const __m512i k = _mm512_min_epi32(_mm512_srli_epi32(grid, 9),
                                       _mm512_permutexvar_epi32(decade, _mm512_load_si512(t.last)));
    if (kSigned) {
      // code - 128: k - 1 for y >= 0, -1 - k below (k = 128, no -1 in the
      // map, saturates to code 0 as well).
      const __mmask16 negative = _mm512_test_epi32_mask(bits, splat(0x80000000u));
      __m512i biased = _mm512_sub_epi32(k, splat(kDirectBias + 1));
      biased = _mm512_mask_sub_epi32(biased, negative, splat(kDirectBias - 1), k);
      const __m128i codes =
          _mm_xor_si128(_mm512_cvtsepi32_epi8(biased), _mm_set1_epi8(static_cast<char>(0x80)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), codes);
    } else {
      // k >= 1 but for +0 (a clamped |y| under the first entry computes 0).
      const __m512i positive = _mm512_max_epi32(k, splat(kDirectBias + 1));
      const __m512i unsigned_k =
          _mm512_mask_mov_epi32(positive, _mm512_testn_epi32_mask(bits, bits), splat(0));
      // The bias is a multiple of 256: the low byte is k.
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(unsigned_k));
    }
    return true;
  }

  using AbsBits = __m512i;
  static AbsBits absbits_none() { return _mm512_setzero_si512(); }
  static AbsBits absbits_max(AbsBits acc, V v) {
    return _mm512_max_epu32(acc, _mm512_and_si512(_mm512_castps_si512(v), splat(0x7FFFFFFFu)));
  }
  static uint32_t absbits_reduce(AbsBits acc) { return _mm512_reduce_max_epu32(acc); }
};

constexpr detail::KernelTable kAvx512Table = make_table<Avx512Ops<false>>();
constexpr detail::KernelTable kAvx512VbmiTable = make_table<Avx512Ops<true>>();

}  // namespace

namespace detail {
const KernelTable* avx512_kernels() {
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  return vbmi ? &kAvx512VbmiTable : &kAvx512Table;
}
const KernelTable* avx512_kernels_without_vbmi() { return &kAvx512Table; }
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
const KernelTable* avx512_kernels_without_vbmi() { return nullptr; }
}  // namespace detail
}  // namespace kernels
}  // namespace optim
}  // namespace roundpipe

#endif
