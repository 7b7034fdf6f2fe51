// roundpipe::optim::Adam/AdamW with compact states (AdamOptions::state_dtype):
// several steps bitwise against a plain torch-op reference of the same
// quantization math, every SIMD path bitwise equal, archives round trip and
// convert between formats, bad input is refused with clear messages, and
// checkpoints and device counts leave the trajectory bitwise unchanged. And
// bf16 parameters: the fp32 update stored with the documented stochastic
// rounding, reproducible, and training like fp32.
#include <roundpipe/checkpoint.h>
#include <roundpipe/optim/adam.h>
#include <roundpipe/optim/sgd.h>
#include <unistd.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "expect_error.h"
#include "models.h"
#include "optim/adam_state.h"
#include "optim/checks.h"
#include "optim/kernels/kernels.h"
#include "stochastic_rounding_reference.h"

namespace roundpipe {
namespace optim {
namespace {

using torch::Tensor;
namespace k = kernels;

constexpr int kSteps = 5;

// Sizes around the block size and the 8-bit threshold.
const std::vector<std::vector<int64_t>> kShapes = {{4096}, {70, 100}, {3000}, {5}, {33, 257}};

std::vector<Tensor> RandomParams(uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<Tensor> out;
  for (const auto& s : kShapes) out.push_back(torch::randn(s).requires_grad_(true));
  return out;
}

std::vector<Tensor> Clones(const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (const Tensor& p : params) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

std::vector<std::vector<Tensor>> RandomGrads(int steps, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<std::vector<Tensor>> out(steps);
  for (auto& grads : out) {
    for (const auto& s : kShapes) grads.push_back(torch::randn(s) * 0.1);
  }
  return out;
}

void RunSteps(const std::vector<Tensor>& params, const std::vector<std::vector<Tensor>>& grads,
              torch::optim::Optimizer& opt) {
  for (const auto& step_grads : grads) {
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = step_grads[i].clone();
    opt.step();
  }
}

const AdamParamState& StateOf(const torch::optim::Optimizer& opt, const Tensor& p) {
  return dynamic_cast<const AdamParamState&>(*opt.state().at(detail::state_key(p)));
}

// Copies of each parameter and its state tensors (an empty tensor where a
// state has none), in parameter order.
std::vector<Tensor> ParamsAndStates(const torch::optim::Optimizer& opt,
                                    const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (const Tensor& p : params) {
    const auto& s = StateOf(opt, p);
    for (const Tensor& t :
         {p.detach(), s.exp_avg(), s.exp_avg_sq(), s.exp_avg_absmax(), s.exp_avg_sq_absmax()}) {
      out.push_back(t.defined() ? t.clone() : torch::empty({0}));
    }
  }
  return out;
}

bool Bitwise(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && torch::equal(a, b);
}

void ExpectSameStates(const torch::optim::Optimizer& a, const torch::optim::Optimizer& b,
                      const std::vector<Tensor>& pa, const std::vector<Tensor>& pb,
                      const std::string& what) {
  for (size_t i = 0; i < pa.size(); ++i) {
    const auto& sa = StateOf(a, pa[i]);
    const auto& sb = StateOf(b, pb[i]);
    EXPECT_EQ(sa.step(), sb.step()) << what << " #" << i;
    EXPECT_TRUE(Bitwise(sa.exp_avg(), sb.exp_avg())) << what << " exp_avg #" << i;
    EXPECT_TRUE(Bitwise(sa.exp_avg_sq(), sb.exp_avg_sq())) << what << " exp_avg_sq #" << i;
    EXPECT_TRUE(Bitwise(sa.max_exp_avg_sq(), sb.max_exp_avg_sq())) << what << " max #" << i;
    EXPECT_TRUE(Bitwise(sa.exp_avg_absmax(), sb.exp_avg_absmax())) << what << " absmax #" << i;
    EXPECT_TRUE(Bitwise(sa.exp_avg_sq_absmax(), sb.exp_avg_sq_absmax()))
        << what << " absmax #" << i;
  }
}

void ExpectSameParams(const std::vector<Tensor>& a, const std::vector<Tensor>& b,
                      const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(Bitwise(a[i], b[i])) << what << " #" << i;
}

// ---- the plain reference: torch ops, one IEEE operation each -----------------

// Elementwise division by a constant (a true division, not a reciprocal).
Tensor Div(const Tensor& a, float c) { return torch::div(a, torch::full_like(a, c)); }

// Correctly rounded sqrt (IEEE, as the kernels; torch's vectorized float sqrt
// may differ by an ulp).
Tensor Sqrt(const Tensor& a) {
  Tensor out = torch::empty_like(a);
  const float* src = a.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i) dst[i] = std::sqrt(src[i]);
  return out;
}

Tensor Map(bool is_signed) {
  return torch::from_blob(const_cast<float*>(k::blockwise8_map(is_signed)), {256}, torch::kFloat)
      .clone();
}

Tensor Dequantize(const Tensor& codes, const Tensor& absmax, bool is_signed) {
  const int64_t n = codes.numel();
  const Tensor scale = absmax.repeat_interleave(k::kBlockwise8BlockSize).narrow(0, 0, n);
  return Map(is_signed).index_select(0, codes.reshape(-1).to(torch::kLong)) * scale;
}

// (codes, absmax) of flat fp32 `x`: absmax = max |x| per block of 256, codes
// the number of midpoints of the map below x / absmax (ties to the lower);
// the unsigned map's first midpoint is 0, so that only 0 gets code 0.
std::pair<Tensor, Tensor> Quantize(const Tensor& x, bool is_signed) {
  const Tensor map = Map(is_signed);
  Tensor midpoints = (map.narrow(0, 0, 255) + map.narrow(0, 1, 255)) * 0.5f;
  if (!is_signed) midpoints[0] = 0.0f;
  const int64_t n = x.numel();
  Tensor codes = torch::empty({n}, torch::kByte);
  Tensor absmax = torch::empty({k::blockwise8_num_blocks(n)}, torch::kFloat);
  for (int64_t b = 0; b < absmax.numel(); ++b) {
    const int64_t begin = b * k::kBlockwise8BlockSize;
    const Tensor block = x.narrow(0, begin, std::min(k::kBlockwise8BlockSize, n - begin));
    const float amax = block.abs().max().item<float>();
    absmax[b] = amax;
    const Tensor y = Div(block, amax > 0 ? amax : 1.0f);
    codes.narrow(0, begin, block.numel()).copy_(torch::searchsorted(midpoints, y));
  }
  return {codes, absmax};
}

// The kernels' Adam formula (kernels.h) on flat fp32 tensors.
void ReferenceAdam(const k::AdamHyper& h, Tensor& p, const Tensor& grad, Tensor& m, Tensor& v,
                   Tensor* max_v) {
  Tensor g = h.maximize ? -grad : grad;
  if (h.coupled_weight_decay) g = g + p * h.weight_decay;
  if (h.decoupled_weight_decay) p = p * h.decay_factor;
  m = m * h.beta1 + g * h.one_minus_beta1;
  v = v * h.beta2 + (g * h.one_minus_beta2) * g;
  Tensor vd = v;
  if (h.amsgrad) {
    *max_v = torch::maximum(*max_v, v);
    vd = *max_v;
  }
  const Tensor denom = Div(Sqrt(vd.contiguous()), h.bias_correction2_sqrt) + h.eps;
  p = p + torch::div(m * h.neg_step_size, denom);
}

// One parameter's reference trajectory in a state format.
struct Reference {
  k::StateFormat format;
  Tensor p;
  Tensor m, v, max_v;  // fp32 / bf16 storage
  Tensor m_codes, m_absmax, v_codes, v_absmax;

  Reference(const Tensor& init, k::StateFormat f, bool amsgrad) : format(f) {
    p = init.detach().reshape(-1).clone();
    const int64_t n = p.numel();
    if (f == k::StateFormat::kBlockwise8) {
      std::tie(m_codes, m_absmax) = Quantize(torch::zeros({n}), true);
      std::tie(v_codes, v_absmax) = Quantize(torch::zeros({n}), false);
    } else {
      const auto dtype = f == k::StateFormat::kFp32 ? torch::kFloat : torch::kBFloat16;
      m = torch::zeros({n}, dtype);
      v = torch::zeros({n}, dtype);
      if (amsgrad) max_v = torch::zeros({n}, dtype);
    }
  }

  void Step(const AdamOptions& o, int64_t step, const Tensor& grad) {
    const auto h = k::make_adam_hyper(o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()),
                                      o.eps(), o.weight_decay(), o.amsgrad(), o.maximize(),
                                      o.decoupled_weight_decay(), step);
    const Tensor g = grad.reshape(-1);
    if (format == k::StateFormat::kBlockwise8) {
      Tensor mf = Dequantize(m_codes, m_absmax, true), vf = Dequantize(v_codes, v_absmax, false);
      ReferenceAdam(h, p, g, mf, vf, nullptr);
      std::tie(m_codes, m_absmax) = Quantize(mf, true);
      std::tie(v_codes, v_absmax) = Quantize(vf, false);
      return;
    }
    Tensor mf = m.to(torch::kFloat), vf = v.to(torch::kFloat), maxf;
    if (o.amsgrad()) maxf = max_v.to(torch::kFloat);
    ReferenceAdam(h, p, g, mf, vf, &maxf);
    m = mf.to(m.scalar_type());
    v = vf.to(v.scalar_type());
    if (o.amsgrad()) max_v = maxf.to(max_v.scalar_type());
  }

  void Expect(const Tensor& param, const AdamParamState& s, const std::string& what) const {
    EXPECT_TRUE(Bitwise(param.detach().reshape(-1), p)) << what << ": parameter";
    if (format == k::StateFormat::kBlockwise8) {
      EXPECT_TRUE(Bitwise(s.exp_avg().reshape(-1), m_codes)) << what << ": exp_avg codes";
      EXPECT_TRUE(Bitwise(s.exp_avg_sq().reshape(-1), v_codes)) << what << ": exp_avg_sq codes";
      EXPECT_TRUE(Bitwise(s.exp_avg_absmax(), m_absmax)) << what << ": exp_avg_absmax";
      EXPECT_TRUE(Bitwise(s.exp_avg_sq_absmax(), v_absmax)) << what << ": exp_avg_sq_absmax";
    } else {
      EXPECT_TRUE(Bitwise(s.exp_avg().reshape(-1), m)) << what << ": exp_avg";
      EXPECT_TRUE(Bitwise(s.exp_avg_sq().reshape(-1), v)) << what << ": exp_avg_sq";
      if (max_v.defined()) {
        EXPECT_TRUE(Bitwise(s.max_exp_avg_sq().reshape(-1), max_v)) << what << ": max_exp_avg_sq";
      }
    }
  }
};

std::vector<AdamOptions> OptionGrid(StateDtype dtype) {
  std::vector<AdamOptions> out = {
      AdamWOptions(1e-2).state_dtype(dtype),
      AdamOptions(3e-3).weight_decay(0.1).maximize(true).betas({0.8, 0.99}).state_dtype(dtype),
  };
  if (dtype != StateDtype::kBlockwise8)
    out.push_back(AdamOptions(1e-2).amsgrad(true).state_dtype(dtype));
  return out;
}

void CheckAgainstReference(StateDtype dtype) {
  for (const AdamOptions& o : OptionGrid(dtype)) {
    const std::string what = std::string(state_dtype_name(dtype)) +
                             (o.decoupled_weight_decay() ? " AdamW" : " Adam") +
                             (o.amsgrad() ? " amsgrad" : "");
    const auto params = RandomParams(11);
    const auto grads = RandomGrads(kSteps, 12);
    std::vector<Reference> refs;
    for (const Tensor& p : params) {
      refs.emplace_back(p, detail::adam_state_format(dtype, p.numel()), o.amsgrad());
    }
    Adam opt(params, o);
    for (int s = 0; s < kSteps; ++s) {
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].mutable_grad() = grads[s][i].clone();
        refs[i].Step(o, s + 1, grads[s][i]);
      }
      opt.step();
      for (size_t i = 0; i < params.size(); ++i) {
        refs[i].Expect(params[i], StateOf(opt, params[i]),
                       what + " step " + std::to_string(s + 1) + " param " + std::to_string(i));
      }
    }
  }
}

TEST(CompactAdam, Bf16StatesMatchPlainReferenceBitwise) {
  CheckAgainstReference(StateDtype::kBFloat16);
}

TEST(CompactAdam, Blockwise8StatesMatchPlainReferenceBitwise) {
  CheckAgainstReference(StateDtype::kBlockwise8);
}

TEST(CompactAdam, Fp32StatesAreTheUnchangedUpdate) {
  // The reference in fp32 is the plain update; and state_dtype(kFloat32) is
  // the default.
  CheckAgainstReference(StateDtype::kFloat32);
  EXPECT_EQ(AdamOptions().state_dtype(), StateDtype::kFloat32);
}

TEST(CompactAdam, StateLayoutPerFormatAndThreshold) {
  const auto params = RandomParams(13);
  const auto grads = RandomGrads(1, 14);
  Adam opt(params, AdamWOptions().state_dtype(StateDtype::kBlockwise8));
  RunSteps(params, grads, opt);
  for (const Tensor& p : params) {
    const auto& s = StateOf(opt, p);
    if (p.numel() >= kMinBlockwise8Numel) {
      EXPECT_EQ(s.exp_avg().scalar_type(), torch::kByte);
      EXPECT_EQ(s.exp_avg().sizes(), p.sizes());
      EXPECT_EQ(s.exp_avg_absmax().numel(), (p.numel() + 255) / 256);
      EXPECT_EQ(s.exp_avg_sq_absmax().scalar_type(), torch::kFloat);
    } else {
      EXPECT_EQ(s.exp_avg().scalar_type(), torch::kFloat);
      EXPECT_FALSE(s.exp_avg_absmax().defined());
    }
  }
}

// Where exp_avg_sq is far below its block's absmax and the gradient then
// stops, exp_avg_sq rounded to 0 would make the update exp_avg / eps (here
// about 5000 lr); with the unsigned map's floor the update stays below lr, as
// fp32 Adam's does.
TEST(CompactAdam, Blockwise8SmallSecondMomentNeverTurnsIntoAHugeUpdate) {
  const double lr = 1e-3;
  Tensor p = torch::zeros({4096}, torch::requires_grad());
  Tensor q = p.detach().clone().requires_grad_(true);
  Adam compact({p}, AdamOptions(lr).state_dtype(StateDtype::kBlockwise8));
  Adam fp32({q}, AdamOptions(lr));
  Tensor g1 = torch::ones({4096});
  g1[1] = 1e-4f;  // (1e-4)^2 is 1e-8 of the block's largest exp_avg_sq
  Tensor g2 = torch::ones({4096});
  g2[1] = 0.0f;
  for (const Tensor& g : {g1, g2}) {
    p.mutable_grad() = g.clone();
    q.mutable_grad() = g.clone();
    compact.step();
    fp32.step();
  }
  const auto& s = StateOf(compact, p);
  EXPECT_EQ(s.exp_avg_sq().scalar_type(), torch::kByte);
  EXPECT_EQ(s.exp_avg_sq()[1].item<int>(), 1) << "the smallest positive code";
  const double moved = std::fabs(p.detach()[1].item<double>());
  const double moved_fp32 = std::fabs(q.detach()[1].item<double>());
  EXPECT_GT(moved_fp32, lr);  // step 1 moves it by about lr
  EXPECT_LT(moved, 2 * lr) << "fp32 Adam moved it by " << moved_fp32;
  EXPECT_GT(moved, 0.5 * lr);
}

// ---- SIMD paths -----------------------------------------------------------------

TEST(CompactAdam, AllSimdPathsGiveBitwiseEqualResults) {
  const char* env = std::getenv("ROUNDPIPE_SIMD");
  const std::string saved = env == nullptr ? "" : env;
  for (StateDtype dtype : {StateDtype::kBFloat16, StateDtype::kBlockwise8}) {
    std::vector<std::vector<Tensor>> results;
    std::vector<std::string> names;
    for (k::Isa isa : {k::Isa::kScalar, k::Isa::kAvx2, k::Isa::kAvx512}) {
      if (!k::isa_supported(isa)) continue;
      k::select_isa(isa);
      const auto params = RandomParams(15);
      AdamW opt(params, AdamWOptions(1e-2).state_dtype(dtype));
      RunSteps(params, RandomGrads(kSteps, 16), opt);
      std::vector<Tensor> out = ParamsAndStates(opt, params);
      results.push_back(out);
      names.push_back(k::isa_name(isa));
    }
    for (size_t i = 1; i < results.size(); ++i) {
      ExpectSameParams(results[0], results[i],
                       std::string(state_dtype_name(dtype)) + ": " + names[0] + " vs " + names[i]);
    }
  }
  k::select_isa(saved);
}

// ---- archives -----------------------------------------------------------------

std::string Archive(const torch::optim::Optimizer& opt) {
  std::stringstream stream;
  torch::save(opt, stream);
  return stream.str();
}

void Load(torch::optim::Optimizer& opt, const std::string& bytes) {
  std::stringstream stream(bytes);
  torch::load(opt, stream);
}

TEST(CompactAdam, StateDictRoundTripsBitwise) {
  for (StateDtype dtype : {StateDtype::kBFloat16, StateDtype::kBlockwise8}) {
    const AdamOptions o = AdamWOptions(1e-2).state_dtype(dtype);
    const auto grads = RandomGrads(2 * kSteps, 18);
    const std::vector<std::vector<Tensor>> first(grads.begin(), grads.begin() + kSteps);
    const std::vector<std::vector<Tensor>> second(grads.begin() + kSteps, grads.end());
    const auto a = RandomParams(17);
    AdamW opt_a(a, o);
    RunSteps(a, first, opt_a);
    const auto b = Clones(a);
    AdamW opt_b(b, o);
    Load(opt_b, Archive(opt_a));
    const std::string what = state_dtype_name(dtype);
    ExpectSameStates(opt_a, opt_b, a, b, what + " loaded");
    RunSteps(a, second, opt_a);
    RunSteps(b, second, opt_b);
    ExpectSameParams(a, b, what + " after more steps");
    ExpectSameStates(opt_a, opt_b, a, b, what + " after more steps");
  }
}

TEST(CompactAdam, LoadingConvertsBetweenFp32AndCompactStates) {
  const auto params = RandomParams(19);
  AdamW fp32(params, AdamWOptions(1e-2));
  RunSteps(params, RandomGrads(kSteps, 20), fp32);
  const std::string fp32_archive = Archive(fp32);

  for (StateDtype dtype : {StateDtype::kBFloat16, StateDtype::kBlockwise8}) {
    const std::string what = state_dtype_name(dtype);
    const auto c = Clones(params);
    AdamW compact(c, AdamWOptions(1e-2).state_dtype(dtype));
    Load(compact, fp32_archive);
    EXPECT_EQ(static_cast<const AdamOptions&>(compact.param_groups()[0].options()).state_dtype(),
              dtype)
        << what << ": the optimizer's own state_dtype is kept";
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& s32 = StateOf(fp32, params[i]);
      const auto& s = StateOf(compact, c[i]);
      EXPECT_EQ(s.step(), kSteps);
      const auto format = detail::adam_state_format(dtype, params[i].numel());
      if (format == k::StateFormat::kBFloat16) {
        EXPECT_TRUE(Bitwise(s.exp_avg(), s32.exp_avg().to(torch::kBFloat16))) << what << i;
        EXPECT_TRUE(Bitwise(s.exp_avg_sq(), s32.exp_avg_sq().to(torch::kBFloat16))) << what << i;
      } else if (format == k::StateFormat::kBlockwise8) {
        const auto [m_codes, m_absmax] = Quantize(s32.exp_avg().reshape(-1), true);
        const auto [v_codes, v_absmax] = Quantize(s32.exp_avg_sq().reshape(-1), false);
        EXPECT_TRUE(Bitwise(s.exp_avg().reshape(-1), m_codes)) << what << i;
        EXPECT_TRUE(Bitwise(s.exp_avg_absmax(), m_absmax)) << what << i;
        EXPECT_TRUE(Bitwise(s.exp_avg_sq().reshape(-1), v_codes)) << what << i;
        EXPECT_TRUE(Bitwise(s.exp_avg_sq_absmax(), v_absmax)) << what << i;
      } else {
        EXPECT_TRUE(Bitwise(s.exp_avg(), s32.exp_avg())) << what << i;
      }
    }

    // And back: an fp32 optimizer loading the compact archive gets the
    // widened (dequantized) states.
    const auto back_params = Clones(params);
    AdamW back(back_params, AdamWOptions(1e-2));
    Load(back, Archive(compact));
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& s = StateOf(compact, c[i]);
      const auto& sb = StateOf(back, back_params[i]);
      EXPECT_EQ(sb.exp_avg().scalar_type(), torch::kFloat);
      EXPECT_FALSE(sb.exp_avg_absmax().defined());
      if (s.exp_avg().scalar_type() == torch::kByte) {
        EXPECT_TRUE(
            Bitwise(sb.exp_avg().reshape(-1), Dequantize(s.exp_avg(), s.exp_avg_absmax(), true)));
        EXPECT_TRUE(Bitwise(sb.exp_avg_sq().reshape(-1),
                            Dequantize(s.exp_avg_sq(), s.exp_avg_sq_absmax(), false)));
      } else {
        EXPECT_TRUE(Bitwise(sb.exp_avg(), s.exp_avg().to(torch::kFloat))) << what << i;
        EXPECT_TRUE(Bitwise(sb.exp_avg_sq(), s.exp_avg_sq().to(torch::kFloat))) << what << i;
      }
    }
  }
}

TEST(CompactAdam, ChangingStateDtypeConvertsAtTheNextStep) {
  const auto params = RandomParams(21);
  const auto grads = RandomGrads(2, 22);
  AdamW opt(params, AdamWOptions(1e-2));
  RunSteps(params, {grads[0]}, opt);
  static_cast<AdamOptions&>(opt.param_groups()[0].options()).state_dtype(StateDtype::kBFloat16);
  RunSteps(params, {grads[1]}, opt);
  for (const Tensor& p : params)
    EXPECT_EQ(StateOf(opt, p).exp_avg().scalar_type(), torch::kBFloat16);
}

// ---- errors -------------------------------------------------------------------

TEST(CompactAdam, RejectsAmsgradWith8BitStates) {
  const auto params = RandomParams(23);
  testing::expect_message(
      testing::error_of<c10::ValueError>(
          [&] { Adam(params, AdamOptions().amsgrad(true).state_dtype(StateDtype::kBlockwise8)); }),
      {"amsgrad is not supported with 8-bit states", "kBFloat16"});
  Adam opt(params, AdamOptions().state_dtype(StateDtype::kBlockwise8));
  static_cast<AdamOptions&>(opt.param_groups()[0].options()).amsgrad(true);
  testing::expect_message(testing::error_of<c10::ValueError>([&] { opt.step(); }),
                          {"amsgrad is not supported with 8-bit states", "parameter group 0"});
}

TEST(CompactAdam, RejectsFp16Fp64AndComplexParameters) {
  for (auto dtype : {torch::kHalf, torch::kDouble, torch::kComplexFloat}) {
    for (StateDtype state : {StateDtype::kFloat32, StateDtype::kBFloat16}) {
      testing::expect_message(
          testing::error_of<c10::TypeError>([&] {
            Adam({torch::randn({4096}), torch::randn({8}).to(dtype)},
                 AdamOptions().state_dtype(state));
          }),
          {"Adam: parameter 1 (group 0, position 1)", "must be float32 or bfloat16, got"});
    }
    // Added after construction: refused at step(), before anything changes.
    const Tensor a = torch::randn({8}, torch::kBFloat16).requires_grad_(true);
    AdamW opt({a});
    const Tensor bad = torch::randn({8}).to(dtype).requires_grad_(true);
    opt.add_param_group(torch::optim::OptimizerParamGroup({bad}));
    a.mutable_grad() = torch::ones_like(a);
    bad.mutable_grad() = torch::ones_like(bad);
    const Tensor before = a.detach().clone();
    testing::expect_message(testing::error_of<c10::TypeError>([&] { opt.step(); }),
                            {"AdamW: parameter 1 (group 1, position 0)", "float32 or bfloat16"});
    EXPECT_TRUE(Bitwise(a.detach(), before));
  }
}

TEST(CompactAdam, RejectsStatesOfTheWrongSizeOrDtypeNamingTheTensor) {
  const auto a = RandomParams(25);
  AdamW opt_a(a, AdamWOptions().state_dtype(StateDtype::kBlockwise8));
  RunSteps(a, RandomGrads(1, 26), opt_a);

  // A wrong absmax in the archive: refused on load, nothing changes.
  auto& s = const_cast<AdamParamState&>(StateOf(opt_a, a[1]));
  const Tensor good_absmax = s.exp_avg_sq_absmax();
  s.exp_avg_sq_absmax(torch::zeros({3}));
  const std::string bad_archive = Archive(opt_a);
  s.exp_avg_sq_absmax(good_absmax);
  const auto b = Clones(a);
  AdamW opt_b(b, AdamWOptions().state_dtype(StateDtype::kBlockwise8));
  testing::expect_message(testing::error_of<c10::ValueError>([&] { Load(opt_b, bad_archive); }),
                          {"AdamW: parameter 1 (group 0, position 1)",
                           "'exp_avg_sq_absmax' has 3 elements", "expected 28"});
  EXPECT_TRUE(opt_b.state().empty());

  // A state of another parameter's size, and a dtype that is no format.
  auto& s0 = const_cast<AdamParamState&>(StateOf(opt_a, a[0]));
  const Tensor good = s0.exp_avg();
  s0.exp_avg(torch::zeros({10}, torch::kByte));
  testing::expect_message(
      testing::error_of<c10::ValueError>([&] { opt_a.step(); }),
      {"AdamW: parameter 0 (group 0, position 0)", "'exp_avg' has 10 elements", "expected 4096"});
  s0.exp_avg(good.to(torch::kDouble));
  testing::expect_message(
      testing::error_of<c10::TypeError>([&] { opt_a.step(); }),
      {"AdamW: parameter 0 (group 0, position 0)", "'exp_avg' has dtype Double"});
  s0.exp_avg(good);
  s0.exp_avg_sq(s0.exp_avg_sq().to(torch::kFloat));
  testing::expect_message(
      testing::error_of<c10::TypeError>([&] { opt_a.step(); }),
      {"AdamW: parameter 0 (group 0, position 0)", "'exp_avg_sq' must be Byte"});
}

// ---- the engine: checkpoints and device counts ----------------------------------

using testing::make_mlp;
using testing::mse_loss_fn;

struct EngineRun {
  RoundPipe model;
  AdamW opt;
  EngineRun(int64_t devices, uint64_t init, StateDtype dtype)
      : model((torch::manual_seed(init), make_mlp(64, 2)),
              RoundPipeOptions().set_max_devices(devices)),
        opt(model.optim_parameters(), AdamWOptions(1e-2).state_dtype(dtype)) {}
  void Step(int k) {
    torch::manual_seed(1000 + k);
    const Tensor x = torch::randn({6, 64}), y = torch::randn({6, 4});
    // A fixed microbatch count: the default depends on the device count.
    model.forward_backward({x}, make_kwargs(), y, mse_loss_fn(), false,
                           RunConfig().num_microbatch(3));
    model.step(
        [this] {
          opt.step();
          opt.zero_grad();
        },
        /*is_async=*/false);
  }
  std::vector<Tensor> Params() {
    model.synchronize();
    std::vector<Tensor> out;
    for (const auto& [name, t] : model.optim_named_parameters()) out.push_back(t.detach().clone());
    return out;
  }
};

TEST(CompactAdam, CheckpointResumeIsBitwiseIdentical) {
  const std::string path =
      ::testing::TempDir() + "compact_adam_" + std::to_string(::getpid()) + ".ckpt";
  for (StateDtype dtype : {StateDtype::kBFloat16, StateDtype::kBlockwise8}) {
    EngineRun full(1, 7, dtype);
    for (int k = 1; k <= 2; ++k) full.Step(k);
    CheckpointState state;
    state.optimizer = &full.opt;
    save_checkpoint(path, full.model, state);
    for (int k = 3; k <= 4; ++k) full.Step(k);

    EngineRun resumed(1, 8, dtype);
    state.optimizer = &resumed.opt;
    load_checkpoint(path, resumed.model, state);
    for (int k = 3; k <= 4; ++k) resumed.Step(k);
    const std::string what = state_dtype_name(dtype);
    ExpectSameParams(full.Params(), resumed.Params(), what + " optimizer copies");
    const auto pf = full.model.optim_parameters(), pr = resumed.model.optim_parameters();
    ExpectSameStates(full.opt, resumed.opt, pf, pr, what + " states");
    EXPECT_EQ(StateOf(full.opt, pf[0]).exp_avg().scalar_type(),
              dtype == StateDtype::kBFloat16 ? torch::kBFloat16 : torch::kByte);
  }
  std::remove(path.c_str());
}

TEST(CompactAdam, BitwiseIdenticalOnOneAndTwoDevices) {
  for (StateDtype dtype : {StateDtype::kBFloat16, StateDtype::kBlockwise8}) {
    EngineRun one(1, 9, dtype), two(2, 9, dtype);
    for (int k = 1; k <= 3; ++k) {
      one.Step(k);
      two.Step(k);
    }
    ExpectSameParams(one.Params(), two.Params(), state_dtype_name(dtype));
    ExpectSameStates(one.opt, two.opt, one.model.optim_parameters(), two.model.optim_parameters(),
                     state_dtype_name(dtype));
  }
}

// ---- bf16 parameters --------------------------------------------------------

// fp32 `x` rounded to bf16 stochastically, element j = position in the
// parameter, with adam.h's seeding: seed = the parameter's index over all
// groups, step = the update's step number.
Tensor StochasticBf16(const Tensor& x, uint64_t seed, uint64_t step) {
  const Tensor flat = x.contiguous().reshape(-1);
  Tensor out = torch::empty({flat.numel()}, torch::kBFloat16);
  const float* src = flat.data_ptr<float>();
  auto* dst = static_cast<uint16_t*>(out.data_ptr());
  for (int64_t j = 0; j < flat.numel(); ++j) {
    dst[j] =
        roundpipe::testing::reference_bf16_stochastic(src[j], seed, step, static_cast<uint64_t>(j));
  }
  return out.reshape(x.sizes());
}

std::vector<Tensor> Bf16(const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (const Tensor& p : params)
    out.push_back(p.detach().to(torch::kBFloat16).requires_grad_(true));
  return out;
}

// A bf16 parameter's expected trajectory: the fp32 reference update of the
// widened parameter (Reference, with the states in their format), then the
// documented stochastic rounding.
struct Bf16Reference {
  Reference fp32;
  uint64_t index;
  Tensor p;  // bf16

  Bf16Reference(const Tensor& init, k::StateFormat f, bool amsgrad, uint64_t param_index)
      : fp32(init.to(torch::kFloat), f, amsgrad), index(param_index), p(init.detach().clone()) {}

  void Step(const AdamOptions& o, int64_t step, const Tensor& grad) {
    fp32.p = p.reshape(-1).to(torch::kFloat);
    fp32.Step(o, step, grad.to(torch::kFloat));
    p = StochasticBf16(fp32.p, index, static_cast<uint64_t>(step)).reshape(p.sizes());
  }
};

TEST(Bf16ParamAdam, StepsMatchFp32UpdateWithDocumentedStochasticRounding) {
  for (StateDtype dtype : {StateDtype::kFloat32, StateDtype::kBFloat16, StateDtype::kBlockwise8}) {
    for (const AdamOptions& o : OptionGrid(dtype)) {
      for (bool bf16_grads : {true, false}) {
        const std::string what = std::string(state_dtype_name(dtype)) +
                                 (o.decoupled_weight_decay() ? " AdamW" : " Adam") +
                                 (o.amsgrad() ? " amsgrad" : "") +
                                 (bf16_grads ? " bf16 grads" : " fp32 grads");
        const auto params = Bf16(RandomParams(31));
        const auto grads = RandomGrads(kSteps, 32);
        std::vector<Bf16Reference> refs;
        for (size_t i = 0; i < params.size(); ++i) {
          refs.emplace_back(params[i], detail::adam_state_format(dtype, params[i].numel()),
                            o.amsgrad(), i);
        }
        Adam opt(params, o);
        for (int s = 0; s < kSteps; ++s) {
          for (size_t i = 0; i < params.size(); ++i) {
            const Tensor g = bf16_grads ? grads[s][i].to(torch::kBFloat16) : grads[s][i];
            params[i].mutable_grad() = g.clone();
            refs[i].Step(o, s + 1, g);
          }
          opt.step();
          for (size_t i = 0; i < params.size(); ++i) {
            const std::string at =
                what + " step " + std::to_string(s + 1) + " param " + std::to_string(i);
            ASSERT_EQ(params[i].scalar_type(), torch::kBFloat16) << at;
            EXPECT_TRUE(Bitwise(params[i].detach(), refs[i].p)) << at << ": parameter";
            // The states: those of the fp32 reference, compared in its layout.
            Reference states = refs[i].fp32;
            states.p = params[i].detach().reshape(-1);
            states.Expect(params[i], StateOf(opt, params[i]), at);
          }
        }
      }
    }
  }
}

// Parameters above the threading grain (32K elements) as well, so that two
// threads split them.
std::vector<Tensor> Bf16ParamsForThreads(uint64_t seed) {
  auto params = RandomParams(seed);
  params.push_back(torch::randn({300, 257}));
  return Bf16(params);
}

// The bf16 parameters and all state tensors after kSteps AdamW steps.
std::vector<Tensor> RunBf16(StateDtype dtype, uint64_t seed) {
  const auto params = Bf16ParamsForThreads(seed);
  torch::manual_seed(seed + 1);
  std::vector<std::vector<Tensor>> grads(kSteps);
  for (auto& step_grads : grads) {
    for (const Tensor& p : params) step_grads.push_back(torch::randn_like(p) * 0.1);
  }
  AdamW opt(params, AdamWOptions(1e-2).state_dtype(dtype));
  RunSteps(params, grads, opt);
  return ParamsAndStates(opt, params);
}

TEST(Bf16ParamAdam, BitwiseEqualOnEverySimdPathAndThreadCount) {
  const char* env = std::getenv("ROUNDPIPE_SIMD");
  const std::string saved = env == nullptr ? "" : env;
  const int threads = at::get_num_threads();
  for (StateDtype dtype : {StateDtype::kFloat32, StateDtype::kBFloat16, StateDtype::kBlockwise8}) {
    k::select_isa(k::Isa::kScalar);
    at::set_num_threads(1);
    const auto expected = RunBf16(dtype, 33);
    for (k::Isa isa : {k::Isa::kScalar, k::Isa::kAvx2, k::Isa::kAvx512}) {
      if (!k::isa_supported(isa)) continue;
      k::select_isa(isa);
      for (int n : {1, 2, 3}) {
        at::set_num_threads(n);
        ExpectSameParams(expected, RunBf16(dtype, 33),
                         std::string(state_dtype_name(dtype)) + ": scalar, 1 thread vs " +
                             k::isa_name(isa) + ", " + std::to_string(n) + " threads");
      }
    }
  }
  at::set_num_threads(threads);
  k::select_isa(saved);
}

TEST(Bf16ParamAdam, UpdatesFarBelowHalfAnUlpMoveTheParameterOnAverage) {
  // Adam's step is about lr per element here (a constant gradient), 1e-4,
  // while a bf16 ulp below 1 is 2^-8: round to nearest would never move
  // the parameter; stochastic rounding follows the fp32 trajectory on average.
  const int64_t n = 4096;
  const int steps = 200;
  const AdamOptions o = AdamOptions(1e-4);
  for (StateDtype dtype : {StateDtype::kFloat32, StateDtype::kBFloat16, StateDtype::kBlockwise8}) {
    const Tensor fp32 = torch::ones({n}).requires_grad_(true);
    const Tensor bf16 = torch::ones({n}, torch::kBFloat16).requires_grad_(true);
    Adam ref({fp32}, o);
    Adam opt({bf16}, AdamOptions(o).state_dtype(dtype));
    for (int s = 0; s < steps; ++s) {
      fp32.mutable_grad() = torch::ones({n});
      bf16.mutable_grad() = torch::ones({n}, torch::kBFloat16);
      ref.step();
      opt.step();
    }
    const double drift = 1.0 - fp32.mean().item<double>();
    const double got = 1.0 - bf16.to(torch::kFloat).mean().item<double>();
    ASSERT_GT(drift, 0.015);  // several ulps, made of steps of under 1/39 ulp
    // Each element errs by under an ulp (2^-8) around the fp32 value; the
    // mean of 4096 much less. A 10% tolerance is far from "did not move".
    EXPECT_NEAR(got, drift, 0.1 * drift) << state_dtype_name(dtype);
  }
}

TEST(Bf16ParamAdam, IdenticalInputsAndResumedRunsAreBitwiseIdentical) {
  for (StateDtype dtype : {StateDtype::kFloat32, StateDtype::kBFloat16, StateDtype::kBlockwise8}) {
    const AdamOptions o = AdamWOptions(1e-2).state_dtype(dtype);
    const std::string what = state_dtype_name(dtype);
    const auto grads = RandomGrads(2 * kSteps, 35);
    const std::vector<std::vector<Tensor>> first(grads.begin(), grads.begin() + kSteps);
    const std::vector<std::vector<Tensor>> second(grads.begin() + kSteps, grads.end());
    const auto a = Bf16(RandomParams(34)), b = Bf16(RandomParams(34));
    AdamW opt_a(a, o), opt_b(b, o);
    RunSteps(a, grads, opt_a);
    RunSteps(b, grads, opt_b);
    ExpectSameParams(a, b, what + " two runs");
    ExpectSameStates(opt_a, opt_b, a, b, what + " two runs");

    // Saved after the first half, loaded into a fresh optimizer over copies
    // of the parameters at that point, continued.
    const auto c = Bf16(RandomParams(34));
    AdamW opt_c(c, o);
    RunSteps(c, first, opt_c);
    const std::string archive = Archive(opt_c);
    const auto d = Clones(c);
    AdamW opt_d(d, o);
    Load(opt_d, archive);
    RunSteps(d, second, opt_d);
    ExpectSameParams(a, d, what + " resumed");
    ExpectSameStates(opt_a, opt_d, a, d, what + " resumed");
  }
}

TEST(Bf16ParamAdam, RegressionTracksTheFp32Run) {
  // Least squares Y = X W: a 64 x 64 W (4096 elements, so 8-bit states
  // apply). The loss is computed in fp32 from the widened parameter, so a
  // bf16 W gets a bf16 gradient.
  torch::manual_seed(36);
  const Tensor x = torch::randn({256, 64});
  const Tensor y = x.matmul(torch::randn({64, 64}) * 0.5);
  const Tensor init = torch::randn({64, 64}) * 0.1;
  auto train = [&](const Tensor& w, torch::optim::Optimizer& opt) {
    double loss = 0;
    for (int s = 0; s < 100; ++s) {
      opt.zero_grad();
      const Tensor l = (x.matmul(w.to(torch::kFloat)) - y).pow(2).mean();
      l.backward();
      opt.step();
      loss = l.item<double>();
    }
    return loss;
  };
  const double initial = (x.matmul(init) - y).pow(2).mean().item<double>();
  for (StateDtype dtype : {StateDtype::kFloat32, StateDtype::kBFloat16, StateDtype::kBlockwise8}) {
    // The reference: an fp32 parameter with the same states, so that only
    // the parameter's precision differs.
    const Tensor w32 = init.clone().requires_grad_(true);
    AdamW ref({w32}, AdamWOptions(1e-2).state_dtype(dtype));
    const double expected = train(w32, ref);
    ASSERT_LT(expected, 0.7 * initial);  // it did learn
    const Tensor w16 = init.to(torch::kBFloat16).requires_grad_(true);
    AdamW opt({w16}, AdamWOptions(1e-2).state_dtype(dtype));
    const double got = train(w16, opt);
    ASSERT_EQ(w16.grad().scalar_type(), torch::kBFloat16);
    EXPECT_NEAR(got, expected, 0.03 * expected) << state_dtype_name(dtype);
  }
}

TEST(Bf16ParamAdam, LowPrecisionCopyOfABf16ParameterIsRefused) {
  const Tensor p = torch::randn({8}, torch::kBFloat16).requires_grad_(true);
  Adam opt({p});
  p.mutable_grad() = torch::ones_like(p);
  testing::expect_message(testing::error_of<c10::ValueError>([&] {
                            opt.step_with_lowp_copy({torch::empty({8}, torch::kBFloat16)});
                          }),
                          {"Adam: parameter 0 (group 0, position 0)", "bfloat16 itself"});
  opt.step_with_lowp_copy({Tensor()});  // an undefined entry is fine
}

TEST(Bf16ParamAdam, SgdRefusesABf16ParameterNamingIt) {
  const Tensor a = torch::randn({8}, torch::kFloat).requires_grad_(true);
  const Tensor b = torch::randn({8}, torch::kBFloat16).requires_grad_(true);
  testing::expect_message(
      testing::error_of<c10::TypeError>([&] {
        SGD({a, b}, SGDOptions(0.1));
      }),
      {"SGD: parameter 1 (group 0, position 1)", "must be float32, got BFloat16"});
}

}  // namespace
}  // namespace optim
}  // namespace roundpipe
