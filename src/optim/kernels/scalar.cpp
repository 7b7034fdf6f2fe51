// The portable kernels: plain C++, the reference for the SIMD paths and the
// path of non-x86 builds. Its main loop works on 4 floats at a time with the
// compiler's generic vector types (SSE2 on x86-64, NEON on arm64); lane-wise
// sqrt is vectorized thanks to -fno-math-errno. The results are the same IEEE
// operations as ScalarOps performs, element by element.
#include "optim/kernels/kernel_impl.h"

namespace roundpipe {
namespace optim {
namespace kernels {
namespace {

#if defined(__GNUC__)  // GCC and Clang
struct PortableOps {
  static constexpr int64_t kWidth = 4;
  static constexpr bool kDirectCodes = false;  // the search is the reference
  // A GCC/Clang vector extension type (16 bytes: SSE2 and NEON registers):
  // element-wise operators in the target's vector instructions.
  typedef float V __attribute__((vector_size(16)));
  using Flag = bool;

  static V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof(v)); }
  static V set1(float a) { return V{a, a, a, a}; }
  static V add(V a, V b) { return a + b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) {
    for (int i = 0; i < kWidth; ++i) a[i] = ScalarOps::sqrt(a[i]);
    return a;
  }
  static V max(V a, V b) {
    for (int i = 0; i < kWidth; ++i) a[i] = ScalarOps::max(a[i], b[i]);
    return a;
  }
  static V neg(V a) { return -a; }
  static void store_bf16(uint16_t* dst, V v) {
    for (int i = 0; i < kWidth; ++i) dst[i] = ScalarOps::bf16_bits(v[i]);
  }
  static void store_fp16(uint16_t* dst, V v) {
    for (int i = 0; i < kWidth; ++i) dst[i] = ScalarOps::fp16_bits(v[i]);
  }
  static Flag flag_none() { return false; }
  static Flag flag_nonfinite(Flag f, V v) {
    for (int i = 0; i < kWidth; ++i) f = ScalarOps::flag_nonfinite(f, v[i]);
    return f;
  }
  static bool flag_any(Flag f) { return f; }

  static V load_bf16(const uint16_t* p) {
    return V{ScalarOps::load_bf16(p), ScalarOps::load_bf16(p + 1), ScalarOps::load_bf16(p + 2),
             ScalarOps::load_bf16(p + 3)};
  }
  static void store_bf16_stochastic(uint16_t* dst, V v, uint64_t j, uint64_t key) {
    for (int i = 0; i < kWidth; ++i) dst[i] = ScalarOps::bf16_stochastic_bits(v[i], j + i, key);
  }
  static V lookup(const float* table, const uint8_t* codes) {
    return V{table[codes[0]], table[codes[1]], table[codes[2]], table[codes[3]]};
  }
  static int64_t dequantize_codes(const Blockwise8Map&, const uint8_t*, float, float*, int64_t) {
    return 0;
  }
  static void store_codes(uint8_t* dst, V y, const float* search) {
    for (int i = 0; i < kWidth; ++i) dst[i] = ScalarOps::nearest_code(y[i], search);
  }
  using AbsBits = uint32_t;
  static AbsBits absbits_none() { return 0; }
  static AbsBits absbits_max(AbsBits acc, V v) {
    for (int i = 0; i < kWidth; ++i) acc = ScalarOps::absbits_max(acc, v[i]);
    return acc;
  }
  static uint32_t absbits_reduce(AbsBits acc) { return acc; }
};
#else
using PortableOps = ScalarOps;
#endif

}  // namespace

namespace detail {

namespace {
constexpr KernelTable kScalarTable = make_table<PortableOps>();
}  // namespace

const KernelTable* scalar_kernels() { return &kScalarTable; }

}  // namespace detail

// Here rather than in kernel_dispatch.cpp: the maps are kernel_impl.h's
// compile-time constants, the same bits in every ISA file.
const float* blockwise8_map(bool is_signed) {
  return is_signed ? kBlockwise8Maps.signed_map.values : kBlockwise8Maps.unsigned_map.values;
}

// Here for the same reason: ScalarOps' stochastic rounding is the one the
// vector paths of adam_update_compact repeat.
void add_bf16_stochastic(uint16_t* acc, const uint16_t* x_bf16, const float* x_fp32, int64_t n,
                         uint64_t seed, uint64_t step) {
  const uint64_t key = sr_key(seed, step);
  for (int64_t i = 0; i < n; ++i) {
    const float x = x_bf16 != nullptr ? ScalarOps::load_bf16(x_bf16 + i) : x_fp32[i];
    const float sum = ScalarOps::load_bf16(acc + i) + x;
    acc[i] = ScalarOps::bf16_stochastic_bits(sum, static_cast<uint64_t>(i), key);
  }
}
}  // namespace kernels
}  // namespace optim
}  // namespace roundpipe
