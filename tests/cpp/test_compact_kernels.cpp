// Tests of the compact-state Adam kernels (kernels.h, adam_update_compact):
// bitwise equality of the ISA tables and of any block-aligned split, plain
// scalar references for the bf16 and blockwise-8 states, the quantization
// error against fp32 Adam, the stochastic rounding of a bf16 parameter, and
// bf16 gradients.
// Only kernels.h, isa_kernels.h and the standard library: the references are
// written out here, element by element.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "optim/kernels/isa_kernels.h"
#include "optim/kernels/kernels.h"
#include "stochastic_rounding_reference.h"

namespace roundpipe {
namespace optim {
namespace kernels {
namespace {

using detail::KernelTable;

const std::vector<int64_t> kLengths = {1, 255, 256, 257, 1000, 4096 + 17};

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

float Bf16ToFloat(uint16_t b) { return FromBits(static_cast<uint32_t>(b) << 16); }

uint16_t Bf16Nearest(float f) {
  if (f != f) return 0x7FC0;
  const uint32_t u = Bits(f);
  return static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}

// Rounds a product to float before it is added: no FMA contraction in the
// references, whatever flags this file is built with.
float Rounded(float x) {
  volatile float v = x;
  return v;
}

// The Adam formula of kernels.h for one element.
void ReferenceAdam(const AdamHyper& h, float grad, float* p, float* m, float* v, float* max_v) {
  float g = h.maximize ? -grad : grad;
  if (h.coupled_weight_decay) g = g + Rounded(h.weight_decay * *p);
  if (h.decoupled_weight_decay) *p = *p * h.decay_factor;
  *m = Rounded(*m * h.beta1) + Rounded(h.one_minus_beta1 * g);
  *v = Rounded(*v * h.beta2) + Rounded(Rounded(h.one_minus_beta2 * g) * g);
  float vd = *v;
  if (h.amsgrad) {
    *max_v = *max_v > *v ? *max_v : *v;
    vd = *max_v;
  }
  const float denom = std::sqrt(vd) / h.bias_correction2_sqrt + h.eps;
  *p = *p + Rounded(h.neg_step_size * *m) / denom;
}

uint16_t Bf16Stochastic(float f, uint64_t seed, uint64_t step, uint64_t j) {
  return roundpipe::testing::reference_bf16_stochastic(f, seed, step, j);
}

// The 255 thresholds between the codes of a map by their definition
// (kernels.h): the midpoints between neighbouring entries, except that the
// unsigned map's first one is 0, so that only 0 gets code 0.
std::vector<float> Thresholds(bool is_signed) {
  const float* map = blockwise8_map(is_signed);
  std::vector<float> out;
  for (int k = 0; k < 255; ++k) out.push_back((map[k] + map[k + 1]) * 0.5f);
  if (!is_signed) out[0] = 0.0f;
  return out;
}

// The code of y by its definition: the number of thresholds below y.
uint8_t ReferenceCode(float y, bool is_signed) {
  int count = 0;
  for (float t : Thresholds(is_signed)) count += t < y ? 1 : 0;
  return static_cast<uint8_t>(count);
}

std::vector<const KernelTable*> SupportedTables() {
  std::vector<const KernelTable*> out = {detail::scalar_kernels()};
  if (isa_supported(Isa::kAvx2)) out.push_back(detail::avx2_kernels());
  if (isa_supported(Isa::kAvx512)) {
    out.push_back(detail::avx512_kernels());
    // The table without the VBMI byte lookups, where the CPU has them.
    if (detail::avx512_kernels_without_vbmi() != detail::avx512_kernels()) {
      out.push_back(detail::avx512_kernels_without_vbmi());
    }
  }
  return out;
}

const char* TableName(const KernelTable* t) {
  if (t == detail::avx512_kernels_without_vbmi()) return "avx512 (no vbmi)";
  if (t == detail::avx512_kernels()) return "avx512";
  if (t == detail::avx2_kernels()) return "avx2";
  return "scalar";
}

// Normal values mixed with zeros of both signs, tiny, subnormal and large ones.
float AwkwardValue(std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  switch (rng() % 12) {
    case 0:
      return 0.0f;
    case 1:
      return -0.0f;
    case 2:
      return normal(rng) * 1e-30f;
    case 3:
      return normal(rng) * 1e-41f;
    case 4:
      return normal(rng) * 1e8f;
    default:
      return normal(rng) * scale;
  }
}

// One update's arrays in chosen formats, owned; copies are independent.
struct Problem {
  StateFormat state_format = StateFormat::kFp32;
  ParamFormat param_format = ParamFormat::kFp32;
  LowpKind lowp_kind = LowpKind::kNone;
  uint64_t sr_seed = 0;
  uint64_t sr_step = 0;
  int64_t sr_offset = 0;
  int64_t n = 0;
  bool use_grad_bf16 = false;  // pass grad_bf16 (and no fp32 gradient)
  std::vector<float> grad, param;
  std::vector<uint16_t> grad_bf16, param_bf16, lowp;
  std::vector<float> m32, v32, max32;
  std::vector<uint16_t> m16, v16, max16;
  std::vector<uint8_t> m_codes, v_codes;
  std::vector<float> m_absmax, v_absmax;

  Problem(StateFormat states, ParamFormat param_fmt, LowpKind lowp_fmt, int64_t length,
          uint64_t seed)
      : state_format(states), param_format(param_fmt), lowp_kind(lowp_fmt), n(length) {
    std::mt19937_64 rng(seed);
    sr_seed = rng();
    sr_step = rng() % 1000 + 1;
    sr_offset = static_cast<int64_t>(rng() % 100000);
    const size_t size = static_cast<size_t>(n);
    grad.resize(size);
    param.resize(size);
    m32.resize(size);
    v32.resize(size);
    max32.resize(size);
    for (size_t i = 0; i < size; ++i) {
      grad[i] = AwkwardValue(rng, 1.0f);
      param[i] = AwkwardValue(rng, 1.0f);
      m32[i] = AwkwardValue(rng, 0.1f);
      v32[i] = std::fabs(AwkwardValue(rng, 0.01f));
      max32[i] = v32[i] * (rng() % 2 == 0 ? 1.0f : 1.5f);
    }
    // A block of zero states, as before the first step.
    for (size_t i = 256; i < std::min<size_t>(size, 512); ++i) m32[i] = v32[i] = max32[i] = 0;
    for (float p : param) param_bf16.push_back(Bf16Nearest(p));
    for (float g : grad) grad_bf16.push_back(Bf16Nearest(g));
    lowp.assign(size, 0);
    for (size_t i = 0; i < size; ++i) {
      m16.push_back(Bf16Nearest(m32[i]));
      v16.push_back(Bf16Nearest(v32[i]));
      max16.push_back(Bf16Nearest(max32[i]));
    }
    m_codes.resize(size);
    v_codes.resize(size);
    m_absmax.resize(static_cast<size_t>(blockwise8_num_blocks(n)));
    v_absmax.resize(m_absmax.size());
    detail::scalar_kernels()->quantize_blockwise8(m32.data(), m_codes.data(), m_absmax.data(), 0, n,
                                                  true);
    detail::scalar_kernels()->quantize_blockwise8(v32.data(), v_codes.data(), v_absmax.data(), 0, n,
                                                  false);
  }

  CompactAdamBuffers Buffers() {
    CompactAdamBuffers b;
    b.state_format = state_format;
    b.param_format = param_format;
    if (use_grad_bf16) {
      b.grad_bf16 = grad_bf16.data();
    } else {
      b.grad = grad.data();
    }
    if (param_format == ParamFormat::kFp32) {
      b.param = param.data();
      b.lowp = lowp.data();
      b.lowp_kind = lowp_kind;
    } else {
      b.param_bf16 = param_bf16.data();
    }
    switch (state_format) {
      case StateFormat::kFp32:
        b.exp_avg.fp32 = m32.data();
        b.exp_avg_sq.fp32 = v32.data();
        b.max_exp_avg_sq.fp32 = max32.data();
        break;
      case StateFormat::kBFloat16:
        b.exp_avg.bf16 = m16.data();
        b.exp_avg_sq.bf16 = v16.data();
        b.max_exp_avg_sq.bf16 = max16.data();
        break;
      case StateFormat::kBlockwise8:
        b.exp_avg.codes = m_codes.data();
        b.exp_avg.absmax = m_absmax.data();
        b.exp_avg_sq.codes = v_codes.data();
        b.exp_avg_sq.absmax = v_absmax.data();
        break;
    }
    b.sr_seed = sr_seed;
    b.sr_step = sr_step;
    b.sr_offset = sr_offset;
    return b;
  }

  // Every array, outputs and inputs, as bytes.
  std::vector<uint8_t> Bytes() const {
    std::vector<uint8_t> out;
    auto append = [&out](const auto& v) {
      const uint8_t* p = reinterpret_cast<const uint8_t*>(v.data());
      out.insert(out.end(), p, p + v.size() * sizeof(v[0]));
    };
    append(grad);
    append(grad_bf16);
    append(param);
    append(param_bf16);
    append(lowp);
    append(m32);
    append(v32);
    append(max32);
    append(m16);
    append(v16);
    append(max16);
    append(m_codes);
    append(v_codes);
    append(m_absmax);
    append(v_absmax);
    return out;
  }

  // Runs `t` over [0, n), cut into ranges at `cuts` (block boundaries).
  void Run(const KernelTable& t, const AdamHyper& h, std::vector<int64_t> cuts = {}) {
    const CompactAdamBuffers b = Buffers();
    int64_t begin = 0;
    cuts.push_back(n);
    for (int64_t end : cuts) {
      t.adam_compact(h, b, begin, std::min(end, n));
      begin = std::min(end, n);
    }
  }
};

// The first byte where a and b differ, or -1.
int64_t FirstDifference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

struct Options {
  const char* name;
  AdamHyper hyper;
};

std::vector<Options> OptionGrid() {
  return {
      {"adam", make_adam_hyper(1e-3, 0.9, 0.999, 1e-8, 0, false, false, false, 3)},
      {"adam_wd_maximize", make_adam_hyper(1e-2, 0.8, 0.99, 1e-6, 0.1, false, true, false, 1)},
      {"adamw", make_adam_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, false, false, true, 7)},
      {"adamw_amsgrad", make_adam_hyper(1e-3, 0.9, 0.95, 1e-8, 0.01, true, false, true, 20)},
  };
}

struct Formats {
  StateFormat states;
  ParamFormat param;
  LowpKind lowp;
};

std::vector<Formats> FormatGrid() {
  std::vector<Formats> out;
  for (StateFormat s : {StateFormat::kFp32, StateFormat::kBFloat16, StateFormat::kBlockwise8}) {
    out.push_back({s, ParamFormat::kFp32, LowpKind::kNone});
    out.push_back({s, ParamFormat::kFp32, LowpKind::kBFloat16});
    out.push_back({s, ParamFormat::kBFloat16Stochastic, LowpKind::kNone});
  }
  return out;
}

std::string Describe(const Formats& f, const Options& o, int64_t n) {
  return "states " + std::to_string(static_cast<int>(f.states)) + " param " +
         std::to_string(static_cast<int>(f.param)) + " lowp " +
         std::to_string(static_cast<int>(f.lowp)) + " " + o.name + " n " + std::to_string(n);
}

TEST(CompactAdamKernels, MapsAreTheDynamicMaps) {
  for (bool is_signed : {true, false}) {
    // The construction of kernels.h, written out again.
    std::vector<float> expected;
    for (int e = 0; e <= 6; ++e) {
      const int f = (is_signed ? 6 : 7) - e;
      for (int j = 0; j < (1 << f); ++j) {
        const double value = (0.1 + 0.9 * (2 * j + 1) / std::pow(2.0, f + 1)) / std::pow(10.0, e);
        expected.push_back(static_cast<float>(value));
        if (is_signed) expected.push_back(-static_cast<float>(value));
      }
    }
    expected.push_back(0.0f);
    expected.push_back(1.0f);
    ASSERT_EQ(expected.size(), 256u);
    std::sort(expected.begin(), expected.end());
    const float* map = blockwise8_map(is_signed);
    for (int k = 0; k < 256; ++k) {
      EXPECT_EQ(Bits(map[k]), Bits(expected[static_cast<size_t>(k)])) << k;
      if (k > 0) {
        EXPECT_LT(map[k - 1], map[k]) << k;
      }
    }
    EXPECT_EQ(map[255], 1.0f);
    EXPECT_EQ(map[is_signed ? 127 : 0], 0.0f);
    if (is_signed) {
      EXPECT_EQ(map[0], -map[254]);
    }
  }
}

TEST(CompactAdamKernels, AllIsasAndSplitsGiveBitwiseEqualResults) {
  const std::vector<const KernelTable*> tables = SupportedTables();
  std::cout << "ISA tables tested:";
  for (const KernelTable* t : tables) std::cout << " " << TableName(t);
  std::cout << "\n";
  uint64_t seed = 1;
  for (const Formats& f : FormatGrid()) {
    for (const Options& o : OptionGrid()) {
      if (o.hyper.amsgrad && f.states == StateFormat::kBlockwise8) continue;
      for (int64_t n : kLengths) {
        const Problem input(f.states, f.param, f.lowp, n, ++seed);
        Problem expected = input;
        expected.Run(*detail::scalar_kernels(), o.hyper);
        ASSERT_NE(FirstDifference(expected.Bytes(), input.Bytes()), -1) << Describe(f, o, n);
        for (const KernelTable* t : tables) {
          Problem whole = input;
          whole.Run(*t, o.hyper);
          EXPECT_EQ(FirstDifference(whole.Bytes(), expected.Bytes()), -1)
              << TableName(t) << " " << Describe(f, o, n);
          Problem split = input;
          split.Run(*t, o.hyper, {256, 512, 768 + 2 * 256});
          EXPECT_EQ(FirstDifference(split.Bytes(), expected.Bytes()), -1)
              << TableName(t) << " split " << Describe(f, o, n);
        }
      }
    }
  }
}

TEST(CompactAdamKernels, OffsetsNearTwoToThe32GiveBitwiseEqualResults) {
  // The vector paths split the element index into 32-bit halves lane by lane.
  for (int64_t offset : {int64_t{0xFFFFFFFF} - 20, int64_t{0x1FFFFFFFF} - 3}) {
    Problem input(StateFormat::kBFloat16, ParamFormat::kBFloat16Stochastic, LowpKind::kNone, 1000,
                  99);
    input.sr_offset = offset;
    const AdamHyper h = OptionGrid()[0].hyper;
    Problem expected = input;
    expected.Run(*detail::scalar_kernels(), h);
    for (const KernelTable* t : SupportedTables()) {
      Problem got = input;
      got.Run(*t, h);
      EXPECT_EQ(FirstDifference(got.Bytes(), expected.Bytes()), -1) << TableName(t) << offset;
    }
  }
}

TEST(CompactAdamKernels, Fp32StatesAndAdamUpdateMatchPlainReference) {
  // The compact kernel with fp32 states and adam_update's kernel share the
  // Adam math: both must be the formula of kernels.h.
  uint64_t seed = 500;
  for (const Options& o : OptionGrid()) {
    for (int64_t n : kLengths) {
      const Problem input(StateFormat::kFp32, ParamFormat::kFp32, LowpKind::kBFloat16, n, ++seed);
      Problem expected = input;
      for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
        ReferenceAdam(o.hyper, input.grad[i], &expected.param[i], &expected.m32[i],
                      &expected.v32[i], &expected.max32[i]);
        expected.lowp[i] = Bf16Nearest(expected.param[i]);
      }
      for (const KernelTable* t : SupportedTables()) {
        Problem got = input;
        got.Run(*t, o.hyper);
        EXPECT_EQ(FirstDifference(got.Bytes(), expected.Bytes()), -1)
            << TableName(t) << " " << o.name << " n " << n;
        Problem plain = input;
        AdamBuffers b;
        b.param = plain.param.data();
        b.grad = plain.grad.data();
        b.exp_avg = plain.m32.data();
        b.exp_avg_sq = plain.v32.data();
        b.max_exp_avg_sq = plain.max32.data();
        b.lowp = plain.lowp.data();
        b.lowp_kind = LowpKind::kBFloat16;
        t->adam(o.hyper, b, 0, n);
        EXPECT_EQ(FirstDifference(plain.Bytes(), expected.Bytes()), -1)
            << TableName(t) << " adam_update " << o.name << " n " << n;
      }
    }
  }
}

TEST(CompactAdamKernels, Bf16StatesMatchPlainReference) {
  uint64_t seed = 1000;
  for (const Options& o : OptionGrid()) {
    for (int64_t n : kLengths) {
      const Problem input(StateFormat::kBFloat16, ParamFormat::kFp32, LowpKind::kBFloat16, n,
                          ++seed);
      Problem expected = input;
      for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
        float p = input.param[i];
        float m = Bf16ToFloat(input.m16[i]);
        float v = Bf16ToFloat(input.v16[i]);
        float max_v = Bf16ToFloat(input.max16[i]);
        ReferenceAdam(o.hyper, input.grad[i], &p, &m, &v, &max_v);
        expected.param[i] = p;
        expected.lowp[i] = Bf16Nearest(p);
        expected.m16[i] = Bf16Nearest(m);
        expected.v16[i] = Bf16Nearest(v);
        if (o.hyper.amsgrad) expected.max16[i] = Bf16Nearest(max_v);
      }
      for (const KernelTable* t : SupportedTables()) {
        Problem got = input;
        got.Run(*t, o.hyper);
        EXPECT_EQ(FirstDifference(got.Bytes(), expected.Bytes()), -1)
            << TableName(t) << " " << o.name << " n " << n;
      }
    }
  }
}

// Blockwise-8 by the definitions of kernels.h, one element at a time. Also
// returns the new states before quantization.
void ReferenceBlockwise8(const AdamHyper& h, Problem* p, std::vector<float>* m_new,
                         std::vector<float>* v_new) {
  const float* smap = blockwise8_map(true);
  const float* umap = blockwise8_map(false);
  m_new->assign(static_cast<size_t>(p->n), 0);
  v_new->assign(static_cast<size_t>(p->n), 0);
  for (int64_t block = 0; block < blockwise8_num_blocks(p->n); ++block) {
    const size_t begin = static_cast<size_t>(block * kBlockwise8BlockSize);
    const size_t end = std::min(begin + kBlockwise8BlockSize, static_cast<size_t>(p->n));
    float m_absmax = 0, v_absmax = 0;
    for (size_t i = begin; i < end; ++i) {
      float m = smap[p->m_codes[i]] * p->m_absmax[static_cast<size_t>(block)];
      float v = umap[p->v_codes[i]] * p->v_absmax[static_cast<size_t>(block)];
      float unused = 0;
      ReferenceAdam(h, p->grad[i], &p->param[i], &m, &v, &unused);
      if (p->lowp_kind == LowpKind::kBFloat16) p->lowp[i] = Bf16Nearest(p->param[i]);
      (*m_new)[i] = m;
      (*v_new)[i] = v;
      m_absmax = std::max(m_absmax, std::fabs(m));
      v_absmax = std::max(v_absmax, std::fabs(v));
    }
    for (size_t i = begin; i < end; ++i) {
      p->m_codes[i] = ReferenceCode((*m_new)[i] / (m_absmax > 0 ? m_absmax : 1.0f), true);
      p->v_codes[i] = ReferenceCode((*v_new)[i] / (v_absmax > 0 ? v_absmax : 1.0f), false);
    }
    p->m_absmax[static_cast<size_t>(block)] = m_absmax;
    p->v_absmax[static_cast<size_t>(block)] = v_absmax;
  }
}

TEST(CompactAdamKernels, Blockwise8MatchesPlainReference) {
  uint64_t seed = 2000;
  for (const Options& o : OptionGrid()) {
    if (o.hyper.amsgrad) continue;
    for (int64_t n : kLengths) {
      const Problem input(StateFormat::kBlockwise8, ParamFormat::kFp32, LowpKind::kBFloat16, n,
                          ++seed);
      Problem expected = input;
      std::vector<float> m_new, v_new;
      ReferenceBlockwise8(o.hyper, &expected, &m_new, &v_new);
      for (const KernelTable* t : SupportedTables()) {
        Problem got = input;
        got.Run(*t, o.hyper);
        EXPECT_EQ(FirstDifference(got.Bytes(), expected.Bytes()), -1)
            << TableName(t) << " " << o.name << " n " << n;
      }
    }
  }
}

// Half the widest gap between neighbours of a map: the largest quantization
// error, relative to the block's absmax.
float HalfWidestGap(const float* map) {
  float gap = 0;
  for (int k = 0; k < 255; ++k) gap = std::max(gap, map[k + 1] - map[k]);
  return gap / 2;
}

TEST(CompactAdamKernels, Blockwise8StepStaysWithinQuantizationErrorOfFp32Adam) {
  const AdamHyper h = make_adam_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, false, false, true, 5);
  const int64_t n = 4096 + 17;
  const Problem input(StateFormat::kBlockwise8, ParamFormat::kFp32, LowpKind::kNone, n, 3000);
  // fp32 Adam from the dequantized states.
  std::vector<float> param = input.param, m(static_cast<size_t>(n)), v(static_cast<size_t>(n));
  const KernelTable& scalar = *detail::scalar_kernels();
  scalar.dequantize_blockwise8(input.m_codes.data(), input.m_absmax.data(), m.data(), 0, n, true);
  scalar.dequantize_blockwise8(input.v_codes.data(), input.v_absmax.data(), v.data(), 0, n, false);
  AdamBuffers fp32;
  fp32.param = param.data();
  fp32.grad = input.grad.data();
  fp32.exp_avg = m.data();
  fp32.exp_avg_sq = v.data();
  scalar.adam(h, fp32, 0, n);

  for (const KernelTable* t : SupportedTables()) {
    Problem got = input;
    got.Run(*t, h);
    // The parameter sees the unquantized states: equal to fp32 Adam's.
    for (size_t i = 0; i < param.size(); ++i) {
      ASSERT_EQ(Bits(got.param[i]), Bits(param[i])) << TableName(t) << " " << i;
    }
    std::vector<float> m_got(static_cast<size_t>(n)), v_got(static_cast<size_t>(n));
    t->dequantize_blockwise8(got.m_codes.data(), got.m_absmax.data(), m_got.data(), 0, n, true);
    t->dequantize_blockwise8(got.v_codes.data(), got.v_absmax.data(), v_got.data(), 0, n, false);
    const float m_error = HalfWidestGap(blockwise8_map(true)) * (1 + 1e-5f);
    const float v_error = HalfWidestGap(blockwise8_map(false)) * (1 + 1e-5f);
    for (int64_t i = 0; i < n; ++i) {
      const size_t block = static_cast<size_t>(i / kBlockwise8BlockSize);
      const size_t k = static_cast<size_t>(i);
      // The new absmax is the fp32 block's.
      EXPECT_LE(std::fabs(m[k]), got.m_absmax[block]);
      EXPECT_LE(std::fabs(v[k]), got.v_absmax[block]);
      EXPECT_LE(std::fabs(m_got[k] - m[k]), m_error * got.m_absmax[block]) << i;
      EXPECT_LE(std::fabs(v_got[k] - v[k]), v_error * got.v_absmax[block]) << i;
    }
  }
}

TEST(CompactAdamKernels, Blockwise8QuantizationIsNearestAndZerosAreExact) {
  std::mt19937_64 rng(4000);
  const int64_t n = 1000;
  std::vector<float> src(static_cast<size_t>(n));
  for (float& x : src) x = AwkwardValue(rng, 3.0f);
  for (size_t i = 256; i < 512; ++i) src[i] = 0;  // a zero block
  for (bool is_signed : {true, false}) {
    std::vector<float> values = src;
    if (!is_signed) {
      for (float& x : values) x = std::fabs(x);
    }
    const float* map = blockwise8_map(is_signed);
    std::vector<uint8_t> expected_codes;
    std::vector<float> expected_absmax;
    for (const KernelTable* t : SupportedTables()) {
      std::vector<uint8_t> codes(values.size());
      std::vector<float> absmax(static_cast<size_t>(blockwise8_num_blocks(n)));
      std::vector<float> back(values.size());
      t->quantize_blockwise8(values.data(), codes.data(), absmax.data(), 0, n, is_signed);
      t->dequantize_blockwise8(codes.data(), absmax.data(), back.data(), 0, n, is_signed);
      if (expected_codes.empty()) {
        expected_codes = codes;
        expected_absmax = absmax;
      }
      EXPECT_EQ(codes, expected_codes) << TableName(t);
      for (size_t b = 0; b < absmax.size(); ++b) {
        EXPECT_EQ(Bits(absmax[b]), Bits(expected_absmax[b])) << TableName(t);
      }
      EXPECT_EQ(absmax[1], 0.0f);
      for (size_t i = 0; i < values.size(); ++i) {
        const float a = absmax[i / kBlockwise8BlockSize];
        const float y = values[i] / (a > 0 ? a : 1.0f);
        ASSERT_EQ(codes[i], ReferenceCode(y, is_signed)) << i;
        // No other entry is nearer (up to the rounding of the midpoints),
        // but the unsigned map's 0 is for a quotient of 0 alone.
        const float error = std::fabs(y - map[codes[i]]);
        if (!is_signed && y > 0) {
          EXPECT_GE(codes[i], 1) << i;
        }
        for (int k : {codes[i] - 1, codes[i] + 1}) {
          if (k >= (!is_signed && y > 0 ? 1 : 0) && k < 256) {
            EXPECT_LE(error, std::fabs(y - map[k]) * (1 + 1e-6f)) << i;
          }
        }
        if (values[i] == 0) {
          EXPECT_EQ(back[i], 0.0f) << i;
        }
      }
    }
  }
}

TEST(CompactAdamKernels, Blockwise8TiesGoToTheLowerCode) {
  // One block: 1 (so absmax = 1 and the division is exact), then every
  // threshold between codes (the unsigned map's first is 0).
  for (bool is_signed : {true, false}) {
    std::vector<float> values = {1.0f};
    for (float t : Thresholds(is_signed)) values.push_back(t);
    for (const KernelTable* t : SupportedTables()) {
      std::vector<uint8_t> codes(values.size());
      float absmax = 0;
      t->quantize_blockwise8(values.data(), codes.data(), &absmax, 0, 256, is_signed);
      EXPECT_EQ(absmax, 1.0f);
      EXPECT_EQ(codes[0], 255);
      for (int k = 0; k < 255; ++k) EXPECT_EQ(codes[static_cast<size_t>(k) + 1], k) << TableName(t);
    }
  }
}

// The vector paths compute most codes from the float's exponent and a linear
// formula per decade of the map, from the value times the reciprocal of the
// absmax, and fall back on the search of the exact quotient only near a
// midpoint. Checked against the definition (the number of midpoints below
// value / absmax, found by bisection here) on a sweep of [-1, 1] (every
// 509th float), every midpoint and its 8 float neighbours on either side, and
// the same values multiplied by absmaxes other than 1, whose reciprocal is
// inexact.
TEST(CompactAdamKernels, Blockwise8CodesAreExactOnADenseSweepAndAtEveryMidpoint) {
  for (bool is_signed : {true, false}) {
    const std::vector<float> midpoints = Thresholds(is_signed);
    auto code_of = [&](float y) {
      if (y != y) return 0;
      return static_cast<int>(std::lower_bound(midpoints.begin(), midpoints.end(), y) -
                              midpoints.begin());
    };
    std::vector<float> ys;
    for (uint32_t u = 0; u <= 0x3F800000u; u += 509) {
      ys.push_back(FromBits(u));
      ys.push_back(FromBits(u | 0x80000000u));
    }
    for (float m : midpoints) {
      for (int delta = -8; delta <= 8; ++delta) {
        const uint32_t u = Bits(m) + static_cast<uint32_t>(delta);
        if ((u & 0x7FFFFFFFu) <= 0x3F800000u) ys.push_back(FromBits(u));
      }
    }
    for (float y : {1.0f, -1.0f, 0.0f, -0.0f, 1e-30f, -1e-41f}) ys.push_back(y);
    for (float absmax : {1.0f, 3.0f, 0.7f, 1.2345e-3f, 6.1e-9f, 8.5e25f, 3e38f, 1e-39f}) {
      // Blocks of one absmax: element 0 holds it, the others y * absmax.
      std::vector<float> src;
      for (size_t i = 0; i < ys.size(); ++i) {
        if (src.size() % kBlockwise8BlockSize == 0) src.push_back(absmax);
        float x = ys[i] * absmax;
        if (!(std::fabs(x) <= absmax)) x = std::copysign(absmax, x);
        src.push_back(x);
      }
      const int64_t n = static_cast<int64_t>(src.size());
      std::vector<uint8_t> expected(src.size());
      for (size_t i = 0; i < src.size(); ++i) {
        expected[i] = static_cast<uint8_t>(code_of(src[i] / absmax));
      }
      for (const KernelTable* t : SupportedTables()) {
        std::vector<uint8_t> codes(src.size());
        std::vector<float> absmaxes(static_cast<size_t>(blockwise8_num_blocks(n)));
        t->quantize_blockwise8(src.data(), codes.data(), absmaxes.data(), 0, n, is_signed);
        for (float a : absmaxes) ASSERT_EQ(a, absmax);
        const int64_t i = FirstDifference(codes, expected);
        ASSERT_EQ(i, -1) << TableName(t) << (is_signed ? " signed" : " unsigned") << " absmax "
                         << absmax << " value " << src[static_cast<size_t>(i)] << " code "
                         << int{codes[static_cast<size_t>(i)]} << " expected "
                         << int{expected[static_cast<size_t>(i)]};
      }
    }
  }
}

TEST(CompactAdamKernels, StochasticRoundingPicksABf16NeighbourByTheDocumentedHash) {
  uint64_t seed = 5000;
  for (const Options& o : OptionGrid()) {
    for (int64_t n : kLengths) {
      const Problem input(StateFormat::kFp32, ParamFormat::kBFloat16Stochastic, LowpKind::kNone, n,
                          ++seed);
      // The fp32 result: the same update on the widened parameter.
      Problem fp32(StateFormat::kFp32, ParamFormat::kFp32, LowpKind::kNone, n, seed);
      for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
        fp32.param[i] = Bf16ToFloat(input.param_bf16[i]);
      }
      fp32.Run(*detail::scalar_kernels(), o.hyper);
      for (const KernelTable* t : SupportedTables()) {
        Problem got = input;
        got.Run(*t, o.hyper);
        for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
          const float exact = fp32.param[i];
          const uint16_t bits = got.param_bf16[i];
          ASSERT_EQ(bits, Bf16Stochastic(exact, input.sr_seed, input.sr_step,
                                         static_cast<uint64_t>(input.sr_offset) + i))
              << TableName(t) << " " << i;
          if (exact != exact) continue;
          const uint16_t down = static_cast<uint16_t>(Bits(exact) >> 16);
          if (Bf16ToFloat(down) == exact) {
            EXPECT_EQ(bits, down) << i;  // exact values stay exact
          } else {
            EXPECT_TRUE(bits == down || bits == down + 1) << i;
          }
        }
      }
    }
  }
}

TEST(CompactAdamKernels, StochasticRoundingIndependentOfTheSplit) {
  const AdamHyper h = OptionGrid()[2].hyper;
  const int64_t n = 4096 + 17;
  for (StateFormat s : {StateFormat::kFp32, StateFormat::kBFloat16, StateFormat::kBlockwise8}) {
    const Problem input(s, ParamFormat::kBFloat16Stochastic, LowpKind::kNone, n, 6000);
    for (const KernelTable* t : SupportedTables()) {
      Problem whole = input;
      whole.Run(*t, h);
      Problem halves = input;
      halves.Run(*t, h, {8 * kBlockwise8BlockSize});
      EXPECT_EQ(FirstDifference(halves.Bytes(), whole.Bytes()), -1) << TableName(t);
      // The second half as an array of its own, placed by sr_offset.
      Problem pieces = input;
      CompactAdamBuffers first = pieces.Buffers();
      const int64_t cut = 8 * kBlockwise8BlockSize;
      t->adam_compact(h, first, 0, cut);
      CompactAdamBuffers second = first;
      second.grad += cut;
      second.param_bf16 += cut;
      second.sr_offset += cut;
      if (s == StateFormat::kFp32) {
        second.exp_avg.fp32 += cut;
        second.exp_avg_sq.fp32 += cut;
      } else if (s == StateFormat::kBFloat16) {
        second.exp_avg.bf16 += cut;
        second.exp_avg_sq.bf16 += cut;
      } else {
        second.exp_avg.codes += cut;
        second.exp_avg_sq.codes += cut;
        second.exp_avg.absmax += cut / kBlockwise8BlockSize;
        second.exp_avg_sq.absmax += cut / kBlockwise8BlockSize;
      }
      t->adam_compact(h, second, 0, n - cut);
      EXPECT_EQ(FirstDifference(pieces.Bytes(), whole.Bytes()), -1) << TableName(t);
    }
  }
}

TEST(CompactAdamKernels, StochasticRoundingIsReproducibleAndChangesWithTheStep) {
  const AdamHyper h = OptionGrid()[0].hyper;
  const int64_t n = 4096 + 17;
  const Problem input(StateFormat::kBFloat16, ParamFormat::kBFloat16Stochastic, LowpKind::kNone, n,
                      7000);
  for (const KernelTable* t : SupportedTables()) {
    Problem a = input, b = input, c = input;
    a.Run(*t, h);
    b.Run(*t, h);
    c.sr_step += 1;
    c.Run(*t, h);
    EXPECT_EQ(a.param_bf16, b.param_bf16) << TableName(t);
    int64_t differ = 0;
    for (size_t i = 0; i < a.param_bf16.size(); ++i) differ += a.param_bf16[i] != c.param_bf16[i];
    // Many updated elements are not exact in bf16; about half of those differ.
    EXPECT_GT(differ, n / 20) << TableName(t);
  }
}

TEST(CompactAdamKernels, StochasticRoundingIsUnbiased) {
  // lr = 0 and a decay factor: every element's fp32 result is x * factor,
  // which bf16 cannot hold; m = v = 0 and eps > 0 leave the rest at zero.
  AdamHyper h;
  h.eps = 1e-8f;
  h.decoupled_weight_decay = true;
  const int64_t n = 1 << 16;
  for (float x : {1.0f, -3.140625f, Bf16ToFloat(Bf16Nearest(1e-20f))}) {
    for (float factor : {0.999f, 0.9977f}) {
      const float exact = x * factor;
      const uint16_t down = static_cast<uint16_t>(Bits(exact) >> 16);
      const double ulp = std::fabs(static_cast<double>(Bf16ToFloat(down + 1)) - Bf16ToFloat(down));
      h.decay_factor = factor;
      for (const KernelTable* t : SupportedTables()) {
        std::vector<uint16_t> param(static_cast<size_t>(n), Bf16Nearest(x));
        std::vector<float> grad(param.size(), 0), m(param.size(), 0), v(param.size(), 0);
        CompactAdamBuffers b;
        b.param_format = ParamFormat::kBFloat16Stochastic;
        b.param_bf16 = param.data();
        b.grad = grad.data();
        b.exp_avg.fp32 = m.data();
        b.exp_avg_sq.fp32 = v.data();
        b.sr_seed = 42;
        b.sr_step = 1;
        t->adam_compact(h, b, 0, n);
        double sum = 0;
        for (uint16_t p : param) {
          ASSERT_TRUE(p == down || p == down + 1);
          sum += Bf16ToFloat(p);
        }
        // Each rounding errs by under one ulp: the mean's standard deviation
        // is below ulp / 2 / sqrt(n) = ulp / 512; allow ten times that.
        EXPECT_NEAR(sum / n, exact, ulp / 50) << TableName(t) << " " << x << " " << factor;
      }
    }
  }
}

// `input` with its gradient passed as bf16 bits (`bf16`) or as the same
// values widened to fp32. The bf16 version's fp32 gradient is all NaN, so that
// reading it would show in every output.
Problem WithBf16Gradient(const Problem& input, bool bf16) {
  Problem out = input;
  for (size_t i = 0; i < out.grad.size(); ++i) {
    out.grad[i] = bf16 ? std::nanf("") : Bf16ToFloat(out.grad_bf16[i]);
  }
  out.use_grad_bf16 = bf16;
  return out;
}

// After a run, the NaN fp32 gradient of WithBf16Gradient(.., true) put back,
// so that all the arrays can be compared.
std::vector<uint8_t> BytesWithWidenedGradient(Problem p) {
  for (size_t i = 0; i < p.grad.size(); ++i) p.grad[i] = Bf16ToFloat(p.grad_bf16[i]);
  return p.Bytes();
}

TEST(CompactAdamKernels, Bf16GradientGivesBitwiseTheResultOfTheWidenedFp32Gradient) {
  uint64_t seed = 9000;
  for (const Formats& f : FormatGrid()) {
    for (const Options& o : OptionGrid()) {
      if (o.hyper.amsgrad && f.states == StateFormat::kBlockwise8) continue;
      for (int64_t n : kLengths) {
        const Problem input(f.states, f.param, f.lowp, n, ++seed);
        Problem expected = WithBf16Gradient(input, false);
        expected.Run(*detail::scalar_kernels(), o.hyper);
        for (const KernelTable* t : SupportedTables()) {
          Problem whole = WithBf16Gradient(input, true);
          whole.Run(*t, o.hyper);
          EXPECT_EQ(FirstDifference(BytesWithWidenedGradient(whole), expected.Bytes()), -1)
              << TableName(t) << " " << Describe(f, o, n);
          Problem split = WithBf16Gradient(input, true);
          split.Run(*t, o.hyper, {256, 512, 768 + 2 * 256});
          EXPECT_EQ(FirstDifference(BytesWithWidenedGradient(split), expected.Bytes()), -1)
              << TableName(t) << " split " << Describe(f, o, n);
        }
      }
    }
  }
}

TEST(CompactAdamKernels, Bf16GradientThroughTheThreadedEntryPoint) {
  // Above the threading grain, so the intra-op threads (if several) split it;
  // the chunks are placed by the bf16 gradient's address.
  const int64_t n = 3 * 32768 + 1000 + 17;
  const AdamHyper h = OptionGrid()[2].hyper;
  for (const Formats& f : FormatGrid()) {
    const Problem input(f.states, f.param, f.lowp, n, 8100);
    Problem expected = WithBf16Gradient(input, false);
    expected.Run(*detail::scalar_kernels(), h);
    Problem got = WithBf16Gradient(input, true);
    adam_update_compact(h, got.Buffers(), n);
    EXPECT_EQ(FirstDifference(BytesWithWidenedGradient(got), expected.Bytes()), -1)
        << Describe(f, OptionGrid()[2], n) << " on " << isa_name(active_isa());
  }
}

TEST(CompactAdamKernels, DispatchedEntryPointsMatchOneScalarCall) {
  // Above the threading grain: split between the intra-op threads, if any,
  // at block boundaries, on the active ISA.
  const int64_t n = 3 * 32768 + 1000 + 17;
  const AdamHyper h = OptionGrid()[2].hyper;
  for (const Formats& f : FormatGrid()) {
    const Problem input(f.states, f.param, f.lowp, n, 8000);
    Problem expected = input;
    expected.Run(*detail::scalar_kernels(), h);
    Problem got = input;
    adam_update_compact(h, got.Buffers(), n);
    EXPECT_EQ(FirstDifference(got.Bytes(), expected.Bytes()), -1)
        << Describe(f, OptionGrid()[2], n) << " on " << isa_name(active_isa());
  }
  const Problem input(StateFormat::kFp32, ParamFormat::kFp32, LowpKind::kNone, n, 8001);
  for (bool is_signed : {true, false}) {
    std::vector<uint8_t> codes(input.m32.size()), expected_codes(codes.size());
    std::vector<float> absmax(static_cast<size_t>(blockwise8_num_blocks(n)));
    std::vector<float> expected_absmax(absmax.size());
    blockwise8_quantize(input.m32.data(), codes.data(), absmax.data(), n, is_signed);
    detail::scalar_kernels()->quantize_blockwise8(input.m32.data(), expected_codes.data(),
                                                  expected_absmax.data(), 0, n, is_signed);
    EXPECT_EQ(codes, expected_codes);
    EXPECT_EQ(absmax, expected_absmax);
    std::vector<float> back(codes.size()), expected_back(codes.size());
    blockwise8_dequantize(codes.data(), absmax.data(), back.data(), n, is_signed);
    detail::scalar_kernels()->dequantize_blockwise8(codes.data(), absmax.data(),
                                                    expected_back.data(), 0, n, is_signed);
    EXPECT_EQ(back, expected_back);
  }
}

}  // namespace
}  // namespace kernels
}  // namespace optim
}  // namespace roundpipe
