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
//   store_bf16/store_fp16 (c10's rounding), and a non-finite Flag accumulator;
// for the compact Adam states:
//   load_bf16, store_bf16_stochastic (ScalarOps::bf16_stochastic_bits),
//   lookup(table, codes) = table[codes[lane]] (table: 256 floats, 64-byte
//   aligned), dequantize_codes(map, codes, absmax, out, len): out[i] =
//   map.values[codes[i]] * absmax for a prefix of [0, len) that it returns
//   (0: the caller does it all with lookup; the vector paths may do whole
//   runs of codes at once), store_codes (nearest_code, same comparisons in
//   the same order), with kDirectCodes also store_codes_direct<kSigned>
//   (the codes by Blockwise8Direct, or false where a lane is near a
//   midpoint; see Avx512Ops), and an AbsBits accumulator: the max of
//   (float bits & 0x7FFFFFFF) over lanes, an integer max, so its result does
//   not depend on the order.
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
  static constexpr bool kDirectCodes = false;  // the search is the reference
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

  static V load_bf16(const uint16_t* p) { return bits_float(static_cast<uint32_t>(*p) << 16); }
  // The stochastic rounding of CompactAdamBuffers::sr_seed for element j.
  static uint16_t bf16_stochastic_bits(float f, uint64_t j, uint64_t key) {
    if (f != f) return 0x7FC0;
    const uint32_t r = sr_hash(static_cast<uint32_t>(j), static_cast<uint32_t>(j >> 32), key);
    return static_cast<uint16_t>((float_bits(f) + (r >> 16)) >> 16);
  }
  static void store_bf16_stochastic(uint16_t* dst, V v, uint64_t j, uint64_t key) {
    *dst = bf16_stochastic_bits(v, j, key);
  }
  static V lookup(const float* table, const uint8_t* codes) { return table[*codes]; }
  template <class Map>
  static int64_t dequantize_codes(const Map&, const uint8_t*, float, float*, int64_t) {
    return 0;
  }
  static void store_codes(uint8_t* dst, V y, const float* search) {
    *dst = nearest_code(y, search);
  }

  using AbsBits = uint32_t;
  static AbsBits absbits_none() { return 0; }
  static AbsBits absbits_max(AbsBits acc, V v) {
    const uint32_t a = float_bits(v) & 0x7FFFFFFFu;
    return a > acc ? a : acc;
  }
  static uint32_t absbits_reduce(AbsBits acc) { return acc; }

  // lowbias32 (Chris Wellons' integer hash); the vector paths repeat it.
  static uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
  }
  static uint32_t sr_hash(uint32_t lo, uint32_t hi, uint64_t key) {
    const uint32_t k0 = static_cast<uint32_t>(key);
    const uint32_t k1 = static_cast<uint32_t>(key >> 32);
    return lowbias32(lowbias32(lo ^ k0) ^ hi ^ k1);
  }
  // The number of midpoints (thresholds[0..254]) below y (NaN: 0): the code
  // of the nearest map entry, ties to the lower one. A branch-free binary
  // search over the midpoints in heap order (Blockwise8Map::search): 8
  // comparisons, each halving the candidate codes; the vector paths run the
  // same comparisons lane by lane.
  static uint8_t nearest_code(float y, const float* search) {
    uint32_t node = 1;
    for (int level = 0; level < 8; ++level) node = 2 * node + (search[node] < y ? 1u : 0u);
    return static_cast<uint8_t>(node - 256);
  }
};

template <class Ops>
inline void store_lowp(uint16_t* dst, typename Ops::V v, LowpKind kind) {
  if (kind == LowpKind::kBFloat16) {
    Ops::store_bf16(dst, v);
  } else if (kind == LowpKind::kFloat16) {
    Ops::store_fp16(dst, v);
  }
}

// ---- Compact-state constants -------------------------------------------------

// Tables of the direct code computation of the vector paths
// (store_codes_direct): the code of y follows from |y| without a search.
// k counts the midpoints below |y| on the non-negative side of the map
// (entries 0 .. K: 0, the decades from 1e-7 up, then 1; K = 128 signed, 255
// unsigned). The side splits into "decade" ranges d = 0 .. 8 at the midpoints
// between decades ("cross" midpoints): d = 0 is the entry 0, d = 1 .. 7 the
// decades 10^-6 .. 10^0, d = 8 the entry 1. Inside decade d the entries are
// equally spaced, so k = floor(|y| * scale[d] + offset[d]) up to rounding,
// capped at last[d] (the formula runs past the decade's last entry up to the
// next cross midpoint). The decade comes from the float's exponent: each of
// the 32 binades [2^(b - 31), 2^(b - 30)) holds at most one cross midpoint c,
// and d = decade_below[b] + (|y| > c). The unsigned map's first cross
// midpoint is 0 (its thresholds[0]), so there d >= 1 for every clamped |y|,
// whose k is then at least 1 once capped below: the vector paths keep k = 0
// for y = +0 alone.
//
// The vector paths work on the float bits: cross_near[b] is c's bits minus
// kDirectNearCross (0x7F000000 where the binade has no c: never reached), so
// that one difference gives both |y| > c and "within kDirectNearCross float
// steps of c". |y| is first clamped to [2^-31, kDirectClampBits], so that the
// exponent's low 5 bits index the binade. Nothing above 1 comes from a value
// divided by its block's absmax; should it (or NaN bits, or a negative y of
// the unsigned map, compared as unsigned), it clamps to kDirectClampBits,
// which cross_near[31] marks as near a midpoint: such lanes take the search.
// The position is rounded to a grid of 2^-9 by adding kDirectGrid; the float
// bits then hold kDirectBias + floor(position) above 9 bits of fraction, and
// a zero fraction marks a position within 2^-10 of a midpoint.
constexpr int32_t kDirectNearCross = 64;
constexpr uint32_t kDirectClampBits = 0x3F900000u;  // 1.125
constexpr uint32_t kDirectMinBits = 0x30000000u;    // 2^-31
constexpr float kDirectGrid = 24576.0f;             // 1.5 * 2^14: floats 2^-9 apart
// The bits of kDirectGrid + p, shifted right by 9, for p in [0, 2^13):
// exponent 141 above 2^13 + floor(p). A multiple of 256, so the low byte is
// floor(p).
constexpr int32_t kDirectBias = (141 << 14) + (1 << 13);
static_assert(kDirectBias % 256 == 0, "the bias leaves the low byte of a code alone");

struct alignas(64) Blockwise8Direct {
  int32_t cross_near[32];
  int32_t decade_below[32];
  float scale[16];
  float offset[16];
  int32_t last[16];  // kDirectBias + the decade's last k
  bool is_signed;
};

// The blockwise-8 maps and the midpoints between neighbours, computed at
// compile time (exactly, so every ISA file holds the same bits). See
// blockwise8_map() in kernels.h for the construction.
struct alignas(64) Blockwise8Map {
  float values[256];
  // thresholds[k] = (values[k] + values[k + 1]) / 2 for k < 255, except
  // the unsigned map's thresholds[0] = 0; [255] = +inf.
  float thresholds[256];
  // The binary search over thresholds[0..254] as a heap: node i (1..255) at
  // depth d = floor(log2 i) splits the 2^(8 - d) codes left at that depth,
  //   search[i] = thresholds[(2 (i - 2^d) + 1) * 2^(7 - d) - 1];
  // below y -> child 2i + 1, else 2i; node 256 + c is code c. Heap order
  // keeps each depth's candidates contiguous, so the vector paths fetch them
  // with in-register permutes of search[0..15], [16..31], ... (depths 0-3,
  // 4, 5, 6 and 7) instead of gathers. search[0] is unused.
  float search[256];
  // value_bytes[b][c]: byte b (little-endian) of values[c]'s bits, for the
  // byte permutes of the AVX-512 VBMI lookups.
  uint8_t value_bytes[4][256];
  Blockwise8Direct direct;
};

struct Blockwise8Maps {
  Blockwise8Map signed_map;
  Blockwise8Map unsigned_map;
};

constexpr void fill_dynamic_map(float* map, bool is_signed) {
  int count = 0;
  for (int e = 0; e <= 6; ++e) {
    const int f = (is_signed ? 6 : 7) - e;
    double decade = 1;
    for (int k = 0; k < e; ++k) decade *= 10;
    for (int j = 0; j < (1 << f); ++j) {
      const double fraction = 0.1 + 0.9 * (2 * j + 1) / static_cast<double>(2 << f);
      const float value = static_cast<float>(fraction / decade);
      map[count++] = value;
      if (is_signed) map[count++] = -value;
    }
  }
  map[count++] = 0.0f;
  map[count++] = 1.0f;
  // Insertion sort, ascending (count == 256).
  for (int a = 1; a < count; ++a) {
    const float x = map[a];
    int b = a;
    for (; b > 0 && map[b - 1] > x; --b) map[b] = map[b - 1];
    map[b] = x;
  }
}

constexpr void fill_thresholds(Blockwise8Map* map, bool is_signed) {
  for (int k = 0; k < 255; ++k) {
    map->thresholds[k] = (map->values[k] + map->values[k + 1]) * 0.5f;
  }
  // The unsigned map keeps code 0 for 0 alone (kernels.h, kBlockwise8).
  if (!is_signed) map->thresholds[0] = 0.0f;
  map->thresholds[255] = __builtin_huge_valf();
  map->search[0] = __builtin_huge_valf();
  for (int depth = 0; depth < 8; ++depth) {
    for (int r = 0; r < (1 << depth); ++r) {
      map->search[(1 << depth) + r] = map->thresholds[(2 * r + 1) * (128 >> depth) - 1];
    }
  }
}

constexpr void fill_direct(Blockwise8Map* map, bool is_signed) {
  Blockwise8Direct& t = map->direct;
  // The non-negative side starts at code 127 (signed) or 0 (unsigned).
  const int first = is_signed ? 127 : 0;
  const int last_k = 255 - first;
  const float* midpoints = map->thresholds + first;  // midpoints[k]: between entries k, k + 1
  t.is_signed = is_signed;
  float cross[8] = {};
  int base = 1;  // k of the decade's first entry
  t.scale[0] = 0;
  t.offset[0] = 0.5f;
  t.last[0] = kDirectBias;
  for (int d = 1; d <= 7; ++d) {
    const int e = 7 - d;
    const int f = (is_signed ? 6 : 7) - e;
    double decade = 1;
    for (int i = 0; i < e; ++i) decade *= 10;
    // Entry j of the decade is decade^-1 (0.1 + 0.9 (j + 1/2) / 2^f): k + 1/2
    // at the entries, k + 1 at the midpoints between them.
    const double steps = static_cast<double>(1 << f);
    t.scale[d] = static_cast<float>(steps * decade / 0.9);
    t.offset[d] = static_cast<float>(base - 0.1 * steps / 0.9);
    t.last[d] = kDirectBias + base + (1 << f) - 1;
    cross[d - 1] = midpoints[base - 1];
    base += 1 << f;
  }
  cross[7] = midpoints[base - 1];  // between the last decade and 1
  t.scale[8] = 0;
  t.offset[8] = static_cast<float>(last_k) + 0.5f;
  t.last[8] = kDirectBias + last_k;
  for (int d = 9; d < 16; ++d) {
    t.scale[d] = 0;
    t.offset[d] = 0.5f;
    t.last[d] = kDirectBias;
  }
  double low = 1;  // 2^(b - 31)
  for (int b = 0; b < 31; ++b) low *= 0.5;
  for (int b = 0; b < 32; ++b) {
    const double high = 2 * low;
    int below = 0;
    uint32_t cross_bits = 0x7F000000u;  // no cross midpoint: far above any clamped |y|
    for (const float c : cross) {
      if (c < low) ++below;
      if (c >= low && c < high) cross_bits = __builtin_bit_cast(uint32_t, c);
    }
    if (b == 31) cross_bits = kDirectClampBits;  // [1, 2): no midpoint, but the clamp
    t.cross_near[b] = static_cast<int32_t>(cross_bits) - kDirectNearCross;
    t.decade_below[b] = below;
    low *= 2;
  }
}

constexpr Blockwise8Maps make_blockwise8_maps() {
  Blockwise8Maps maps{};
  fill_dynamic_map(maps.signed_map.values, true);
  fill_dynamic_map(maps.unsigned_map.values, false);
  fill_thresholds(&maps.signed_map, true);
  fill_thresholds(&maps.unsigned_map, false);
  fill_direct(&maps.signed_map, true);
  fill_direct(&maps.unsigned_map, false);
  for (Blockwise8Map* map : {&maps.signed_map, &maps.unsigned_map}) {
    for (int c = 0; c < 256; ++c) {
      const uint32_t bits = __builtin_bit_cast(uint32_t, map->values[c]);
      for (int b = 0; b < 4; ++b) map->value_bytes[b][c] = static_cast<uint8_t>(bits >> (8 * b));
    }
  }
  return maps;
}

constexpr Blockwise8Maps kBlockwise8Maps = make_blockwise8_maps();

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline uint64_t sr_key(uint64_t seed, uint64_t step) { return splitmix64(splitmix64(seed) ^ step); }

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

// Accessors of the parameter and the states in their storage formats: load()
// widens element i (and the following lanes) to fp32, store() narrows it.
template <class Ops>
struct Fp32Param {
  using V = typename Ops::V;
  float* param;
  uint16_t* lowp;
  LowpKind lowp_kind;
  V load(int64_t i) const { return Ops::load(param + i); }
  void store(int64_t i, V p) const {
    Ops::store(param + i, p);
    if (lowp_kind != LowpKind::kNone) store_lowp<Ops>(lowp + i, p, lowp_kind);
  }
};

template <class Ops>
struct Bf16StochasticParam {
  using V = typename Ops::V;
  uint16_t* param;
  uint64_t offset;  // sr_offset
  uint64_t key;     // sr_key(sr_seed, sr_step)
  V load(int64_t i) const { return Ops::load_bf16(param + i); }
  void store(int64_t i, V p) const {
    Ops::store_bf16_stochastic(param + i, p, offset + static_cast<uint64_t>(i), key);
  }
};

// The gradient, fp32 or bf16 bits; a bf16 gradient is widened exactly (its
// bits shifted into the high half), so it updates bitwise as the fp32 array
// holding the same values would.
template <class Ops>
struct Fp32Grad {
  const float* grad;
  typename Ops::V load(int64_t i) const { return Ops::load(grad + i); }
};

template <class Ops>
struct Bf16Grad {
  const uint16_t* grad;
  typename Ops::V load(int64_t i) const { return Ops::load_bf16(grad + i); }
};

template <class Ops>
struct Fp32States {
  using V = typename Ops::V;
  float *m, *v, *max_v;
  V load_m(int64_t i) const { return Ops::load(m + i); }
  V load_v(int64_t i) const { return Ops::load(v + i); }
  V load_max_v(int64_t i) const { return Ops::load(max_v + i); }
  void store_m(int64_t i, V x) const { Ops::store(m + i, x); }
  void store_v(int64_t i, V x) const { Ops::store(v + i, x); }
  void store_max_v(int64_t i, V x) const { Ops::store(max_v + i, x); }
};

template <class Ops>
struct Bf16States {
  using V = typename Ops::V;
  uint16_t *m, *v, *max_v;
  V load_m(int64_t i) const { return Ops::load_bf16(m + i); }
  V load_v(int64_t i) const { return Ops::load_bf16(v + i); }
  V load_max_v(int64_t i) const { return Ops::load_bf16(max_v + i); }
  void store_m(int64_t i, V x) const { Ops::store_bf16(m + i, x); }
  void store_v(int64_t i, V x) const { Ops::store_bf16(v + i, x); }
  void store_max_v(int64_t i, V x) const { Ops::store_bf16(max_v + i, x); }
};

// One block of blockwise-8 states, dequantized into fp32 scratch (indexed
// from the block start) before the update, which updates them in place;
// quantize_block() narrows them once the whole block is updated.
template <class Ops>
struct Blockwise8BlockStates {
  using V = typename Ops::V;
  float *m, *v;
  int64_t block_begin;
  V load_m(int64_t i) const { return Ops::load(m + (i - block_begin)); }
  V load_v(int64_t i) const { return Ops::load(v + (i - block_begin)); }
  void store_m(int64_t i, V x) const { Ops::store(m + (i - block_begin), x); }
  void store_v(int64_t i, V x) const { Ops::store(v + (i - block_begin), x); }
  // No amsgrad with blockwise-8 states.
  V load_max_v(int64_t) const { return Ops::set1(0); }
  void store_max_v(int64_t, V) const {}
};

// The Adam math of kernels.h for element i (and the following lanes).
template <class Ops, class Grad, class States, class Param>
inline void adam_at(const AdamHyper& h, const AdamConsts<Ops>& c, const Grad& grad, const States& s,
                    const Param& q, int64_t i) {
  using V = typename Ops::V;
  V g = grad.load(i);
  if (h.maximize) g = Ops::neg(g);
  V p = q.load(i);
  if (h.coupled_weight_decay) g = Ops::add(g, Ops::mul(c.weight_decay, p));
  if (h.decoupled_weight_decay) p = Ops::mul(p, c.decay_factor);
  const V m = Ops::add(Ops::mul(s.load_m(i), c.beta1), Ops::mul(c.one_minus_beta1, g));
  V v = Ops::add(Ops::mul(s.load_v(i), c.beta2), Ops::mul(Ops::mul(c.one_minus_beta2, g), g));
  s.store_m(i, m);
  s.store_v(i, v);
  if (h.amsgrad) {
    v = Ops::max(s.load_max_v(i), v);
    s.store_max_v(i, v);
  }
  const V denom = Ops::add(Ops::div(Ops::sqrt(v), c.bias_correction2_sqrt), c.eps);
  p = Ops::add(p, Ops::div(Ops::mul(c.neg_step_size, m), denom));
  q.store(i, p);
}

// adam_at over [begin, end): whole vectors, then the remainder in ScalarOps.
template <class Ops, template <class> class Grad, template <class> class States,
          template <class> class Param>
inline void adam_loop_with(const AdamHyper& h, const Grad<Ops>& grad, const Grad<ScalarOps>& grad1,
                           const States<Ops>& s, const States<ScalarOps>& s1, const Param<Ops>& q,
                           const Param<ScalarOps>& q1, int64_t begin, int64_t end) {
  int64_t i = begin;
  const AdamConsts<Ops> c(h);
  for (; i + Ops::kWidth <= end; i += Ops::kWidth) adam_at<Ops>(h, c, grad, s, q, i);
  const AdamConsts<ScalarOps> cs(h);
  for (; i < end; ++i) adam_at<ScalarOps>(h, cs, grad1, s1, q1, i);
}

// The gradient of one update: fp32, or bf16 bits (used when non-null).
struct GradSource {
  const float* fp32;
  const uint16_t* bf16;
};

// adam_loop_with over the gradient's storage format. The choice is made here,
// once per range (per block for blockwise-8 states), not per element.
template <class Ops, template <class> class States, template <class> class Param>
inline void adam_loop(const AdamHyper& h, const GradSource& grad, const States<Ops>& s,
                      const States<ScalarOps>& s1, const Param<Ops>& q, const Param<ScalarOps>& q1,
                      int64_t begin, int64_t end) {
  if (grad.bf16 != nullptr) {
    adam_loop_with<Ops>(h, Bf16Grad<Ops>{grad.bf16}, Bf16Grad<ScalarOps>{grad.bf16}, s, s1, q, q1,
                        begin, end);
  } else {
    adam_loop_with<Ops>(h, Fp32Grad<Ops>{grad.fp32}, Fp32Grad<ScalarOps>{grad.fp32}, s, s1, q, q1,
                        begin, end);
  }
}

template <class Ops>
void adam_range(const AdamHyper& hyper, const AdamBuffers& buffers, int64_t begin, int64_t end) {
  // Local copies: the compiler can keep them in registers across the stores.
  const AdamHyper h = hyper;
  const AdamBuffers b = buffers;
  const Fp32States<Ops> s{b.exp_avg, b.exp_avg_sq, b.max_exp_avg_sq};
  const Fp32States<ScalarOps> s1{b.exp_avg, b.exp_avg_sq, b.max_exp_avg_sq};
  const Fp32Param<Ops> q{b.param, b.lowp, b.lowp_kind};
  const Fp32Param<ScalarOps> q1{b.param, b.lowp, b.lowp_kind};
  adam_loop<Ops>(h, GradSource{b.grad, nullptr}, s, s1, q, q1, begin, end);
}

// ---- Adam with compact states ---------------------------------------------

// The whole vectors of codes[0, len) from values[0, len) / divisor by the
// direct computation, each vector the search on the exact quotient instead
// where the direct one cannot vouch for its result. Returns the number of
// codes written.
template <class Ops, bool kSigned>
inline int64_t store_codes_direct(const float* values, int64_t len, float reciprocal, float divisor,
                                  const Blockwise8Map& map, uint8_t* codes) {
  const typename Ops::V r = Ops::set1(reciprocal);
  const typename Ops::V d = Ops::set1(divisor);
  int64_t i = 0;
  for (; i + Ops::kWidth <= len; i += Ops::kWidth) {
    const typename Ops::V x = Ops::load(values + i);
    if (!Ops::template store_codes_direct<kSigned>(codes + i, Ops::mul(x, r), map.direct)) {
      Ops::store_codes(codes + i, Ops::div(x, d), map.search);
    }
  }
  return i;
}

// codes[0, len) and *absmax from values[0, len) (one block): the absmax is the
// integer max of the magnitudes' bits, so NaN wins over inf over any number
// and the order of the lanes does not matter.
template <class Ops>
inline void quantize_block(const float* values, int64_t len, const Blockwise8Map& map,
                           uint8_t* codes, float* absmax) {
  typename Ops::AbsBits acc = Ops::absbits_none();
  int64_t i = 0;
  for (; i + Ops::kWidth <= len; i += Ops::kWidth)
    acc = Ops::absbits_max(acc, Ops::load(values + i));
  uint32_t bits = Ops::absbits_reduce(acc);
  for (; i < len; ++i) bits = ScalarOps::absbits_max(bits, values[i]);
  const float amax = bits_float(bits);
  // A block of zeros divides by 1 (0/0 would give NaN codes); a non-finite
  // absmax is stored as is and makes the whole block non-finite.
  const float divisor = amax > 0 ? amax : 1.0f;
  const typename Ops::V d = Ops::set1(divisor);
  i = 0;
  if constexpr (Ops::kDirectCodes) {
    // The direct codes work from the values times the reciprocal of the
    // divisor (a product instead of a division) and give way to the search on
    // the exact quotient where that could differ; the reciprocal has to be a
    // normal number for that bound to hold.
    if (divisor >= 0x1.0p-126f && divisor <= 0x1.0p+126f) {
      const float reciprocal = 1.0f / divisor;
      i = map.direct.is_signed
              ? store_codes_direct<Ops, true>(values, len, reciprocal, divisor, map, codes)
              : store_codes_direct<Ops, false>(values, len, reciprocal, divisor, map, codes);
    }
  }
  for (; i + Ops::kWidth <= len; i += Ops::kWidth) {
    Ops::store_codes(codes + i, Ops::div(Ops::load(values + i), d), map.search);
  }
  for (; i < len; ++i) codes[i] = ScalarOps::nearest_code(values[i] / divisor, map.search);
  *absmax = amax;
}

// out[0, len) = map.values[codes[i]] * absmax: what Ops::dequantize_codes
// does at once, then vectors of lookups, then single elements.
template <class Ops>
inline void dequantize_block(const Blockwise8Map& map, const uint8_t* codes, float absmax,
                             float* out, int64_t len) {
  int64_t i = Ops::dequantize_codes(map, codes, absmax, out, len);
  const typename Ops::V a = Ops::set1(absmax);
  for (; i + Ops::kWidth <= len; i += Ops::kWidth) {
    Ops::store(out + i, Ops::mul(Ops::lookup(map.values, codes + i), a));
  }
  for (; i < len; ++i) out[i] = map.values[codes[i]] * absmax;
}

// Software prefetch of the arrays of the block kPrefetchBlocks ahead (3072
// elements, about 5 us of work): a blockwise-8 step spends so many
// instructions per element that the out-of-order window holds few of its
// loads, and with threads sharing memory it drew well under the bandwidth an
// fp32 step gets; prefetching a few blocks ahead keeps more requests in
// flight (about 10% per thread with two threads streaming).
constexpr int64_t kPrefetchBlocks = 12;

inline void prefetch_lines(const void* p, int64_t bytes, bool write) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) {
    if (write) {
      __builtin_prefetch(c + i, 1);
    } else {
      __builtin_prefetch(c + i, 0);
    }
  }
}

inline void prefetch_block(const CompactAdamBuffers& b, int64_t i) {
  const int64_t n = kBlockwise8BlockSize;
  if (b.grad_bf16 != nullptr) {
    prefetch_lines(b.grad_bf16 + i, n * 2, false);
  } else {
    prefetch_lines(b.grad + i, n * 4, false);
  }
  if (b.param_format == ParamFormat::kFp32) {
    prefetch_lines(b.param + i, n * 4, true);
    if (b.lowp_kind != LowpKind::kNone) prefetch_lines(b.lowp + i, n * 2, true);
  } else {
    prefetch_lines(b.param_bf16 + i, n * 2, true);
  }
  prefetch_lines(b.exp_avg.codes + i, n, true);
  prefetch_lines(b.exp_avg_sq.codes + i, n, true);
}

template <class Ops, template <class> class Param>
void adam_blockwise8(const AdamHyper& h, const CompactAdamBuffers& b, const Param<Ops>& q,
                     const Param<ScalarOps>& q1, int64_t begin, int64_t end) {
  // The block's states in fp32: dequantized, updated, then quantized.
  alignas(64) float m_new[kBlockwise8BlockSize];
  alignas(64) float v_new[kBlockwise8BlockSize];
  for (int64_t block_begin = begin; block_begin < end; block_begin += kBlockwise8BlockSize) {
    const int64_t ahead = block_begin + kPrefetchBlocks * kBlockwise8BlockSize;
    if (ahead + kBlockwise8BlockSize <= end) prefetch_block(b, ahead);
    const int64_t block_end =
        end - block_begin < kBlockwise8BlockSize ? end : block_begin + kBlockwise8BlockSize;
    const int64_t block = block_begin / kBlockwise8BlockSize;
    const int64_t len = block_end - block_begin;
    dequantize_block<Ops>(kBlockwise8Maps.signed_map, b.exp_avg.codes + block_begin,
                          b.exp_avg.absmax[block], m_new, len);
    dequantize_block<Ops>(kBlockwise8Maps.unsigned_map, b.exp_avg_sq.codes + block_begin,
                          b.exp_avg_sq.absmax[block], v_new, len);
    const Blockwise8BlockStates<Ops> s{m_new, v_new, block_begin};
    const Blockwise8BlockStates<ScalarOps> s1{m_new, v_new, block_begin};
    adam_loop<Ops>(h, GradSource{b.grad, b.grad_bf16}, s, s1, q, q1, block_begin, block_end);
    quantize_block<Ops>(m_new, len, kBlockwise8Maps.signed_map, b.exp_avg.codes + block_begin,
                        b.exp_avg.absmax + block);
    quantize_block<Ops>(v_new, len, kBlockwise8Maps.unsigned_map, b.exp_avg_sq.codes + block_begin,
                        b.exp_avg_sq.absmax + block);
  }
}

template <class Ops, template <class> class Param>
void adam_compact_states(const AdamHyper& h, const CompactAdamBuffers& b, const Param<Ops>& q,
                         const Param<ScalarOps>& q1, int64_t begin, int64_t end) {
  switch (b.state_format) {
    case StateFormat::kFp32: {
      const Fp32States<Ops> s{b.exp_avg.fp32, b.exp_avg_sq.fp32, b.max_exp_avg_sq.fp32};
      const Fp32States<ScalarOps> s1{b.exp_avg.fp32, b.exp_avg_sq.fp32, b.max_exp_avg_sq.fp32};
      adam_loop<Ops>(h, GradSource{b.grad, b.grad_bf16}, s, s1, q, q1, begin, end);
      break;
    }
    case StateFormat::kBFloat16: {
      const Bf16States<Ops> s{b.exp_avg.bf16, b.exp_avg_sq.bf16, b.max_exp_avg_sq.bf16};
      const Bf16States<ScalarOps> s1{b.exp_avg.bf16, b.exp_avg_sq.bf16, b.max_exp_avg_sq.bf16};
      adam_loop<Ops>(h, GradSource{b.grad, b.grad_bf16}, s, s1, q, q1, begin, end);
      break;
    }
    case StateFormat::kBlockwise8:
      adam_blockwise8<Ops>(h, b, q, q1, begin, end);
      break;
  }
}

template <class Ops>
void adam_compact_range(const AdamHyper& hyper, const CompactAdamBuffers& buffers, int64_t begin,
                        int64_t end) {
  const AdamHyper h = hyper;
  const CompactAdamBuffers b = buffers;
  if (b.param_format == ParamFormat::kFp32) {
    const Fp32Param<Ops> q{b.param, b.lowp, b.lowp_kind};
    const Fp32Param<ScalarOps> q1{b.param, b.lowp, b.lowp_kind};
    adam_compact_states<Ops>(h, b, q, q1, begin, end);
  } else {
    const uint64_t offset = static_cast<uint64_t>(b.sr_offset);
    const uint64_t key = sr_key(b.sr_seed, b.sr_step);
    const Bf16StochasticParam<Ops> q{b.param_bf16, offset, key};
    const Bf16StochasticParam<ScalarOps> q1{b.param_bf16, offset, key};
    adam_compact_states<Ops>(h, b, q, q1, begin, end);
  }
}

template <class Ops>
void quantize_blockwise8_range(const float* src, uint8_t* codes, float* absmax, int64_t begin,
                               int64_t end, bool is_signed) {
  const Blockwise8Map& map = is_signed ? kBlockwise8Maps.signed_map : kBlockwise8Maps.unsigned_map;
  for (int64_t block_begin = begin; block_begin < end; block_begin += kBlockwise8BlockSize) {
    const int64_t len =
        end - block_begin < kBlockwise8BlockSize ? end - block_begin : kBlockwise8BlockSize;
    quantize_block<Ops>(src + block_begin, len, map, codes + block_begin,
                        absmax + block_begin / kBlockwise8BlockSize);
  }
}

template <class Ops>
void dequantize_blockwise8_range(const uint8_t* codes, const float* absmax, float* dst,
                                 int64_t begin, int64_t end, bool is_signed) {
  const Blockwise8Map& map = is_signed ? kBlockwise8Maps.signed_map : kBlockwise8Maps.unsigned_map;
  for (int64_t block_begin = begin; block_begin < end; block_begin += kBlockwise8BlockSize) {
    const int64_t len =
        end - block_begin < kBlockwise8BlockSize ? end - block_begin : kBlockwise8BlockSize;
    dequantize_block<Ops>(map, codes + block_begin, absmax[block_begin / kBlockwise8BlockSize],
                          dst + block_begin, len);
  }
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
  return detail::KernelTable{&adam_range<Ops>,
                             &sgd_range<Ops>,
                             &unscale_range<Ops>,
                             &convert_range<Ops>,
                             &adam_compact_range<Ops>,
                             &quantize_blockwise8_range<Ops>,
                             &dequantize_blockwise8_range<Ops>};
}

}  // namespace
}  // namespace kernels
}  // namespace optim
}  // namespace roundpipe
