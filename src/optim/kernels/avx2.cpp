// The AVX2 kernels (8 floats per vector). Compiled with -mavx2 -mfma
// -ffp-contract=off; called only after the dispatcher checked the CPU.
#include "optim/kernels/isa_kernels.h"

#if defined(__x86_64__) && defined(__AVX2__)

#include <immintrin.h>

#include "optim/kernels/kernel_impl.h"

namespace roundpipe {
namespace optim {
namespace kernels {
namespace {

inline __m256i splat(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }

struct Avx2Ops {
  static constexpr int64_t kWidth = 8;
  static constexpr bool kDirectCodes = true;
  using V = __m256;
  using Flag = __m256i;  // all-ones lanes where a non-finite value was seen

  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V neg(V a) { return _mm256_xor_ps(a, _mm256_castsi256_ps(splat(0x80000000u))); }

  // Eight 32-bit lanes holding values <= 0xFFFF -> eight uint16_t.
  static void store_u16(uint16_t* dst, __m256i x) {
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
  }
  static __m256i nan_mask(V v) { return _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }

  // Lane-wise ScalarOps::bf16_bits.
  static void store_bf16(uint16_t* dst, V v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), splat(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, splat(0x7FFF))), 16);
    store_u16(dst, _mm256_blendv_epi8(rounded, splat(0x7FC0), nan_mask(v)));
  }

  // Lane-wise ScalarOps::fp16_bits.
  static void store_fp16(uint16_t* dst, V v) {
    const __m256i w = _mm256_castps_si256(v);
    const V abs = _mm256_castsi256_ps(_mm256_and_si256(w, splat(0x7FFFFFFFu)));
    V base = _mm256_mul_ps(_mm256_mul_ps(abs, set1(kScaleToInf)), set1(kScaleToZero));
    const __m256i shl1_w = _mm256_add_epi32(w, w);
    const __m256i sign = _mm256_and_si256(w, splat(0x80000000u));
    const __m256i bias =
        _mm256_max_epu32(_mm256_and_si256(shl1_w, splat(0xFF000000u)), splat(0x71000000u));
    base = _mm256_add_ps(
        _mm256_castsi256_ps(_mm256_add_epi32(_mm256_srli_epi32(bias, 1), splat(0x07800000u))),
        base);
    const __m256i bits = _mm256_castps_si256(base);
    const __m256i exp_bits = _mm256_and_si256(_mm256_srli_epi32(bits, 13), splat(0x7C00u));
    const __m256i mantissa_bits = _mm256_and_si256(bits, splat(0xFFFu));
    const __m256i nonsign = _mm256_add_epi32(exp_bits, mantissa_bits);
    store_u16(dst, _mm256_or_si256(_mm256_srli_epi32(sign, 16),
                                   _mm256_blendv_epi8(nonsign, splat(0x7E00u), nan_mask(v))));
  }

  static Flag flag_none() { return _mm256_setzero_si256(); }
  static Flag flag_nonfinite(Flag f, V v) {
    const __m256i exponent = _mm256_and_si256(_mm256_castps_si256(v), splat(0x7F800000u));
    return _mm256_or_si256(f, _mm256_cmpeq_epi32(exponent, splat(0x7F800000u)));
  }
  static bool flag_any(Flag f) { return !_mm256_testz_si256(f, f); }

  static V load_bf16(const uint16_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }

  static __m256i lowbias32(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, splat(0x7FEB352Du));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, splat(0x846CA68Bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }

  // Lane-wise ScalarOps::bf16_stochastic_bits for elements j .. j + 7.
  static void store_bf16_stochastic(uint16_t* dst, V v, uint64_t j, uint64_t key) {
    const __m256i lo0 = splat(static_cast<uint32_t>(j));
    const __m256i lo = _mm256_add_epi32(lo0, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    // hi = (j >> 32) + carry; the all-ones lanes of no_carry (lo >= lo0) add -1.
    const __m256i no_carry = _mm256_cmpeq_epi32(_mm256_max_epu32(lo, lo0), lo);
    const __m256i hi = _mm256_add_epi32(splat(static_cast<uint32_t>(j >> 32) + 1u), no_carry);
    __m256i h = lowbias32(_mm256_xor_si256(lo, splat(static_cast<uint32_t>(key))));
    h = lowbias32(
        _mm256_xor_si256(_mm256_xor_si256(h, hi), splat(static_cast<uint32_t>(key >> 32))));
    const __m256i u = _mm256_castps_si256(v);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_srli_epi32(h, 16)), 16);
    store_u16(dst, _mm256_blendv_epi8(rounded, splat(0x7FC0), nan_mask(v)));
  }

  static V lookup(const float* table, const uint8_t* codes) {
    const __m256i idx =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
    return _mm256_i32gather_ps(table, idx, 4);
  }
  // Element by element: a gather per 8 codes costs far more (on CPUs with
  // the gather microcode mitigations, several times the whole step).
  static int64_t dequantize_codes(const Blockwise8Map& map, const uint8_t* codes, float absmax,
                                  float* out, int64_t len) {
    for (int64_t i = 0; i < len; ++i) out[i] = map.values[codes[i]] * absmax;
    return len;
  }

  // Lane-wise ScalarOps::nearest_code.
  static void store_codes(uint8_t* dst, V y, const float* search) {
    __m256i node = splat(1);
    for (int depth = 0; depth < 8; ++depth) {
      const V t = _mm256_i32gather_ps(search, node, 4);
      const __m256i below = _mm256_castps_si256(_mm256_cmp_ps(t, y, _CMP_LT_OQ));
      // below is -1 where t < y: node = 2 node + 1 there.
      node = _mm256_sub_epi32(_mm256_add_epi32(node, node), below);
    }
    // node = 256 + code: keep the low byte before the saturating packs.
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst),
                     narrow_bytes(_mm256_and_si256(node, splat(0xFF))));
  }

  // Eight lanes holding 0..255 -> their bytes in the low 8 bytes (two
  // unsigned saturating packs, which keep such values as they are).
  static __m128i narrow_bytes(__m256i x) {
    const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    return _mm_packus_epi16(w16, w16);
  }

  // table[idx mod 16] and table[idx mod 32] per lane (64-byte aligned
  // tables): permutes of 8 entries, blended by bits 3 and 4 of idx.
  static __m256i select_by_bit(__m256i a, __m256i b, __m256i idx, int bit) {
    const __m256 mask = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 31 - bit));
    return _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), mask));
  }
  static __m256i permute8(const int32_t* table, __m256i idx) {
    return _mm256_permutevar8x32_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(table)),
                                       idx);
  }
  static __m256i permute16(const int32_t* table, __m256i idx) {
    return select_by_bit(permute8(table, idx), permute8(table + 8, idx), idx, 3);
  }
  static __m256i permute32(const int32_t* table, __m256i idx) {
    return select_by_bit(permute16(table, idx), permute16(table + 16, idx), idx, 4);
  }
  static V permute16(const float* table, __m256i idx) {
    return _mm256_castsi256_ps(permute16(reinterpret_cast<const int32_t*>(table), idx));
  }

  // Avx512Ops::store_codes_direct in 8 lanes, the same operations (the
  // unsigned compares made of min and equality, the saturating narrowing of
  // two packs): see there and Blockwise8Direct (kernel_impl.h).
  template <bool kSigned>
  static bool store_codes_direct(uint8_t* dst, V y, const Blockwise8Direct& t) {
    const __m256i bits = _mm256_castps_si256(y);
    const __m256i magnitude = kSigned ? _mm256_and_si256(bits, splat(0x7FFFFFFFu)) : bits;
    const __m256i abs = _mm256_max_epu32(_mm256_min_epu32(magnitude, splat(kDirectClampBits)),
                                         splat(kDirectMinBits));
    const __m256i binade = _mm256_srli_epi32(abs, 23);
    const __m256i to_cross = _mm256_sub_epi32(abs, permute32(t.cross_near, binade));
    const __m256i below = permute32(t.decade_below, binade);
    // above is -1 where to_cross > kDirectNearCross: decade = below + 1 there.
    const __m256i above = _mm256_cmpgt_epi32(to_cross, splat(kDirectNearCross));
    const __m256i decade = _mm256_sub_epi32(below, above);
    const V pos = _mm256_fmadd_ps(_mm256_castsi256_ps(abs), permute16(t.scale, decade),
                                  permute16(t.offset, decade));
    const __m256i grid = _mm256_castps_si256(_mm256_add_ps(pos, set1(kDirectGrid)));
    // to_cross < 2 kDirectNearCross as unsigned numbers: min(x, c - 1) == x.
    const __m256i near_cross =
        _mm256_cmpeq_epi32(_mm256_min_epu32(to_cross, splat(2 * kDirectNearCross - 1)), to_cross);
    const __m256i on_grid =
        _mm256_cmpeq_epi32(_mm256_and_si256(grid, splat(0x1FF)), _mm256_setzero_si256());
    if (_mm256_movemask_epi8(_mm256_or_si256(near_cross, on_grid)) != 0) return false;
    const __m256i k = _mm256_min_epi32(_mm256_srli_epi32(grid, 9), permute16(t.last, decade));
    __m128i narrow;
    if (kSigned) {
      const __m256i negative = _mm256_srai_epi32(bits, 31);
      const __m256i up = _mm256_sub_epi32(k, splat(kDirectBias + 1));
      const __m256i down = _mm256_sub_epi32(splat(kDirectBias - 1), k);
      const __m256i biased = _mm256_blendv_epi8(up, down, negative);
      const __m128i w16 =
          _mm_packs_epi32(_mm256_castsi256_si128(biased), _mm256_extracti128_si256(biased, 1));
      narrow = _mm_xor_si128(_mm_packs_epi16(w16, w16), _mm_set1_epi8(static_cast<char>(0x80)));
    } else {
      const __m256i positive = _mm256_max_epi32(k, splat(kDirectBias + 1));
      const __m256i zero = _mm256_cmpeq_epi32(bits, _mm256_setzero_si256());
      narrow = narrow_bytes(_mm256_andnot_si256(zero, _mm256_and_si256(positive, splat(0xFF))));
    }
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), narrow);
    return true;
  }

  using AbsBits = __m256i;
  static AbsBits absbits_none() { return _mm256_setzero_si256(); }
  static AbsBits absbits_max(AbsBits acc, V v) {
    return _mm256_max_epu32(acc, _mm256_and_si256(_mm256_castps_si256(v), splat(0x7FFFFFFFu)));
  }
  static uint32_t absbits_reduce(AbsBits acc) {
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
    uint32_t out = 0;
    for (uint32_t x : lanes) out = x > out ? x : out;
    return out;
  }
};

constexpr detail::KernelTable kAvx2Table = make_table<Avx2Ops>();

}  // namespace

namespace detail {
const KernelTable* avx2_kernels() { return &kAvx2Table; }
}  // namespace detail

}  // namespace kernels
}  // namespace optim
}  // namespace roundpipe

#else  // not built for x86 with AVX2 flags

namespace roundpipe {
namespace optim {
namespace kernels {
namespace detail {
const KernelTable* avx2_kernels() { return nullptr; }
}  // namespace detail
}  // namespace kernels
}  // namespace optim
}  // namespace roundpipe

#endif
