// Tests of roundpipe::optim::Adam / AdamW / SGD and their SIMD kernels:
// parity with libtorch's optimizers (or a plain-tensor reference where
// libtorch 1.13 lacks an option), bitwise equality across thread counts and
// SIMD paths, state dict round trips, errors, low-precision write-back and
// unscale_and_check.
#include <roundpipe/optim/adam.h>
#include <roundpipe/optim/sgd.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "expect_error.h"
#include "optim/checks.h"
#include "optim/kernels/kernels.h"

namespace roundpipe {
namespace optim {
namespace {

using torch::Tensor;
namespace k = kernels;

constexpr int kSteps = 10;
constexpr double kRtol = 1e-6;

// ---- helpers ---------------------------------------------------------------

std::vector<Tensor> RandomParams(const std::vector<std::vector<int64_t>>& shapes, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<Tensor> out;
  for (const auto& s : shapes) out.push_back(torch::randn(s).requires_grad_(true));
  return out;
}

std::vector<Tensor> CloneParams(const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (const Tensor& p : params) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// One random gradient per parameter and step; the same for every optimizer.
std::vector<std::vector<Tensor>> RandomGrads(const std::vector<Tensor>& params, int steps,
                                             uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<std::vector<Tensor>> out(steps);
  for (auto& grads : out) {
    for (const Tensor& p : params) grads.push_back(torch::randn(p.sizes()));
  }
  return out;
}

void SetGrads(const std::vector<Tensor>& params, const std::vector<Tensor>& grads) {
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
}

// Runs `steps` steps of `step` on `params` with the given gradients.
void RunSteps(const std::vector<Tensor>& params, const std::vector<std::vector<Tensor>>& grads,
              const std::function<void()>& step) {
  for (const auto& g : grads) {
    SetGrads(params, g);
    step();
  }
}

// |a - b| <= rtol * |b| + atol elementwise, with atol = rtol * (1e-3 + the
// step sizes involved): the last bits of tiny updates near zero are relative
// to the update, not to the value.
void ExpectClose(const std::vector<Tensor>& ours, const std::vector<Tensor>& ref, double atol,
                 const std::string& what) {
  ASSERT_EQ(ours.size(), ref.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    const Tensor a = ours[i].detach();
    const Tensor b = ref[i].detach();
    ASSERT_EQ(a.sizes(), b.sizes());
    if (a.numel() == 0) continue;
    const Tensor err = (a - b).abs() - (kRtol * b.abs() + atol);
    const double worst = err.max().item<double>();
    EXPECT_LE(worst, 0.0) << what << ": parameter " << i << " differs by up to "
                          << (a - b).abs().max().item<double>();
  }
}

void ExpectBitwiseEqual(const std::vector<Tensor>& a, const std::vector<Tensor>& b,
                        const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].detach().view(torch::kInt32), b[i].detach().view(torch::kInt32)))
        << what << ": parameter " << i;
  }
}

// Restores the intra-op thread count and the SIMD selection on scope exit.
class ThreadsAndIsaGuard {
 public:
  ThreadsAndIsaGuard() : threads_(at::get_num_threads()) {
    const char* env = std::getenv("ROUNDPIPE_SIMD");
    had_env_ = env != nullptr;
    if (had_env_) env_ = env;
  }
  ~ThreadsAndIsaGuard() {
    at::set_num_threads(threads_);
    k::set_max_isa_for_testing(k::Isa::kAvx512);
    if (had_env_) {
      setenv("ROUNDPIPE_SIMD", env_.c_str(), 1);
    } else {
      unsetenv("ROUNDPIPE_SIMD");
    }
    k::select_isa_from_env();
  }

 private:
  int threads_;
  bool had_env_ = false;
  std::string env_;
};

std::vector<k::Isa> SupportedIsas() {
  std::vector<k::Isa> out;
  for (k::Isa isa : {k::Isa::kScalar, k::Isa::kAvx2, k::Isa::kAvx512}) {
    if (k::isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

void UseIsa(k::Isa isa) {
  setenv("ROUNDPIPE_SIMD", k::isa_name(isa), 1);
  ASSERT_EQ(k::select_isa_from_env(), isa);
  ASSERT_EQ(k::active_isa(), isa);
}

// ---- plain-tensor references for what libtorch 1.13 lacks -----------------

// torch.optim.Adam's single-tensor update, with maximize and decoupled decay.
class RefAdam {
 public:
  RefAdam(std::vector<Tensor> params, const AdamOptions& o) : params_(std::move(params)), o_(o) {
    for (const Tensor& p : params_) {
      m_.push_back(torch::zeros_like(p));
      v_.push_back(torch::zeros_like(p));
      max_v_.push_back(torch::zeros_like(p));
    }
  }
  void step() {
    torch::NoGradGuard no_grad;
    ++t_;
    const double beta1 = std::get<0>(o_.betas());
    const double beta2 = std::get<1>(o_.betas());
    for (size_t i = 0; i < params_.size(); ++i) {
      Tensor p = params_[i];
      Tensor g = o_.maximize() ? -p.grad() : p.grad();
      if (o_.weight_decay() != 0) {
        if (o_.decoupled_weight_decay()) {
          p.mul_(1 - o_.lr() * o_.weight_decay());
        } else {
          g = g.add(p, o_.weight_decay());
        }
      }
      m_[i].mul_(beta1).add_(g, 1 - beta1);
      v_[i].mul_(beta2).addcmul_(g, g, 1 - beta2);
      const double bc1 = 1 - std::pow(beta1, t_);
      const double bc2 = 1 - std::pow(beta2, t_);
      Tensor v = v_[i];
      if (o_.amsgrad()) {
        torch::max_out(max_v_[i], max_v_[i], v_[i]);
        v = max_v_[i];
      }
      const Tensor denom = (v.sqrt() / std::sqrt(bc2)).add_(o_.eps());
      p.addcdiv_(m_[i], denom, -o_.lr() / bc1);
    }
  }

 private:
  std::vector<Tensor> params_, m_, v_, max_v_;
  AdamOptions o_;
  int64_t t_ = 0;
};

// torch.optim.SGD's single-tensor update, with maximize.
class RefSgd {
 public:
  RefSgd(std::vector<Tensor> params, const SGDOptions& o)
      : params_(std::move(params)), o_(o), buf_(params_.size()) {}
  void step() {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      Tensor p = params_[i];
      Tensor g = o_.maximize() ? -p.grad() : p.grad();
      if (o_.weight_decay() != 0) g = g.add(p, o_.weight_decay());
      if (o_.momentum() != 0) {
        if (!buf_[i].defined()) {
          buf_[i] = g.clone();
        } else {
          buf_[i].mul_(o_.momentum()).add_(g, 1 - o_.dampening());
        }
        g = o_.nesterov() ? g.add(buf_[i], o_.momentum()) : buf_[i];
      }
      p.add_(g, -o_.lr());
    }
  }

 private:
  std::vector<Tensor> params_;
  SGDOptions o_;
  std::vector<Tensor> buf_;
};

torch::optim::AdamOptions TorchAdamOptions(const AdamOptions& o) {
  return torch::optim::AdamOptions(o.lr())
      .betas(o.betas())
      .eps(o.eps())
      .weight_decay(o.weight_decay())
      .amsgrad(o.amsgrad());
}

torch::optim::AdamWOptions TorchAdamWOptions(const AdamOptions& o) {
  return torch::optim::AdamWOptions(o.lr())
      .betas(o.betas())
      .eps(o.eps())
      .weight_decay(o.weight_decay())
      .amsgrad(o.amsgrad());
}

torch::optim::SGDOptions TorchSgdOptions(const SGDOptions& o) {
  return torch::optim::SGDOptions(o.lr())
      .momentum(o.momentum())
      .dampening(o.dampening())
      .weight_decay(o.weight_decay())
      .nesterov(o.nesterov());
}

std::string Describe(const AdamOptions& o) {
  std::ostringstream s;
  s << "lr=" << o.lr() << " betas=(" << std::get<0>(o.betas()) << "," << std::get<1>(o.betas())
    << ") eps=" << o.eps() << " wd=" << o.weight_decay() << " amsgrad=" << o.amsgrad()
    << " maximize=" << o.maximize() << " decoupled=" << o.decoupled_weight_decay();
  return s.str();
}

std::string Describe(const SGDOptions& o) {
  std::ostringstream s;
  s << "lr=" << o.lr() << " momentum=" << o.momentum() << " dampening=" << o.dampening()
    << " wd=" << o.weight_decay() << " nesterov=" << o.nesterov() << " maximize=" << o.maximize();
  return s.str();
}

// Our Adam (AdamW when decoupled) against libtorch's Adam / AdamW, or RefAdam
// when maximize is set, for kSteps steps.
void CheckAdamParity(const std::vector<Tensor>& init, const AdamOptions& o, uint64_t seed) {
  const auto grads = RandomGrads(init, kSteps, seed);
  const std::vector<Tensor> ours = CloneParams(init);
  const std::vector<Tensor> ref = CloneParams(init);
  std::unique_ptr<Adam> opt;
  if (o.decoupled_weight_decay()) {
    opt = std::make_unique<AdamW>(ours, o);
  } else {
    opt = std::make_unique<Adam>(ours, o);
  }
  RunSteps(ours, grads, [&] { opt->step(); });
  if (o.maximize()) {
    RefAdam ref_opt(ref, o);
    RunSteps(ref, grads, [&] { ref_opt.step(); });
  } else if (o.decoupled_weight_decay()) {
    torch::optim::AdamW ref_opt(ref, TorchAdamWOptions(o));
    RunSteps(ref, grads, [&] { ref_opt.step(); });
  } else {
    torch::optim::Adam ref_opt(ref, TorchAdamOptions(o));
    RunSteps(ref, grads, [&] { ref_opt.step(); });
  }
  // Each step moves a parameter by at most ~lr; allow the last bits of that.
  ExpectClose(ours, ref, kRtol * (1e-3 + kSteps * o.lr()), Describe(o));
}

void CheckSgdParity(const std::vector<Tensor>& init, const SGDOptions& o, uint64_t seed) {
  const auto grads = RandomGrads(init, kSteps, seed);
  const std::vector<Tensor> ours = CloneParams(init);
  const std::vector<Tensor> ref = CloneParams(init);
  SGD opt(ours, o);
  RunSteps(ours, grads, [&] { opt.step(); });
  if (o.maximize()) {
    RefSgd ref_opt(ref, o);
    RunSteps(ref, grads, [&] { ref_opt.step(); });
  } else {
    torch::optim::SGD ref_opt(ref, TorchSgdOptions(o));
    RunSteps(ref, grads, [&] { ref_opt.step(); });
  }
  // SGD steps are up to ~lr * |g| / (1 - momentum): allow the last bits of those.
  ExpectClose(ours, ref, kRtol * (1e-3 + 2 * kSteps * o.lr()), Describe(o));
}

const std::vector<std::vector<int64_t>> kGridShapes = {{0},  {1},       {7},          {16},
                                                       {33}, {3, 5, 7}, {2, 3, 4, 5}, {300}};

// Every size 0..1024 once, as separate parameters of one optimizer.
std::vector<std::vector<int64_t>> AllSizes() {
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t n = 0; n <= 1024; ++n) shapes.push_back({n});
  return shapes;
}

// ---- parity ---------------------------------------------------------------

TEST(OptimAdamTest, MatchesTorchOverOptionGrid) {
  uint64_t seed = 1;
  for (double lr : {1e-3, 0.1}) {
    for (auto betas : {std::make_tuple(0.9, 0.999), std::make_tuple(0.5, 0.8)}) {
      for (double eps : {1e-8, 1e-3}) {
        for (double wd : {0.0, 0.1}) {
          for (bool amsgrad : {false, true}) {
            for (bool maximize : {false, true}) {
              for (bool decoupled : {false, true}) {
                const AdamOptions o = AdamOptions(lr)
                                          .betas(betas)
                                          .eps(eps)
                                          .weight_decay(wd)
                                          .amsgrad(amsgrad)
                                          .maximize(maximize)
                                          .decoupled_weight_decay(decoupled);
                CheckAdamParity(RandomParams(kGridShapes, seed), o, seed + 1000);
                ++seed;
              }
            }
          }
        }
      }
    }
  }
}

TEST(OptimAdamTest, MatchesTorchForEverySizeUpTo1024) {
  const auto init = RandomParams(AllSizes(), 7);
  CheckAdamParity(init, AdamOptions(1e-2).weight_decay(0.05).amsgrad(true), 8);
  CheckAdamParity(init, AdamWOptions(1e-2), 9);
  CheckAdamParity(init, AdamOptions(1e-2).maximize(true), 10);
}

TEST(OptimAdamTest, ReferenceMatchesTorchWhereBothExist) {
  // Validates RefAdam, which stands in for torch where libtorch 1.13 lacks an option.
  for (bool decoupled : {false, true}) {
    const AdamOptions o =
        AdamOptions(0.05).weight_decay(0.1).amsgrad(true).decoupled_weight_decay(decoupled);
    const auto init = RandomParams(kGridShapes, 3);
    const auto grads = RandomGrads(init, kSteps, 4);
    const auto a = CloneParams(init);
    const auto b = CloneParams(init);
    RefAdam ref(a, o);
    RunSteps(a, grads, [&] { ref.step(); });
    if (decoupled) {
      torch::optim::AdamW t(b, TorchAdamWOptions(o));
      RunSteps(b, grads, [&] { t.step(); });
    } else {
      torch::optim::Adam t(b, TorchAdamOptions(o));
      RunSteps(b, grads, [&] { t.step(); });
    }
    ExpectClose(a, b, 0.0, Describe(o));
  }
}

TEST(OptimAdamTest, AdamWDefaultsAreTorchAdamWs) {
  const auto init = RandomParams(kGridShapes, 5);
  const auto grads = RandomGrads(init, kSteps, 6);
  const auto ours = CloneParams(init);
  const auto ref = CloneParams(init);
  AdamW opt(ours);
  const auto& o = static_cast<const AdamOptions&>(opt.defaults());
  EXPECT_EQ(o.weight_decay(), 1e-2);
  EXPECT_TRUE(o.decoupled_weight_decay());
  torch::optim::AdamW ref_opt(ref);
  RunSteps(ours, grads, [&] { opt.step(); });
  RunSteps(ref, grads, [&] { ref_opt.step(); });
  ExpectClose(ours, ref, kRtol * 1e-2, "AdamW defaults");
}

TEST(OptimSGDTest, MatchesTorchOverOptionGrid) {
  uint64_t seed = 100;
  for (double lr : {1e-2, 0.5}) {
    for (double momentum : {0.0, 0.9}) {
      for (double dampening : {0.0, 0.3}) {
        for (double wd : {0.0, 0.1}) {
          for (bool nesterov : {false, true}) {
            if (nesterov && (momentum == 0 || dampening != 0)) continue;
            for (bool maximize : {false, true}) {
              const SGDOptions o = SGDOptions(lr)
                                       .momentum(momentum)
                                       .dampening(dampening)
                                       .weight_decay(wd)
                                       .nesterov(nesterov)
                                       .maximize(maximize);
              CheckSgdParity(RandomParams(kGridShapes, seed), o, seed + 1000);
              ++seed;
            }
          }
        }
      }
    }
  }
}

TEST(OptimSGDTest, MatchesTorchForEverySizeUpTo1024) {
  const auto init = RandomParams(AllSizes(), 11);
  CheckSgdParity(init, SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01), 12);
  CheckSgdParity(init, SGDOptions(0.05).momentum(0.5).dampening(0.1).maximize(true), 13);
}

TEST(OptimAdamTest, SkipsParametersWithoutGradientAndReturnsClosureLoss) {
  auto params = RandomParams({{5}, {6}}, 21);
  const Tensor untouched = params[1].detach().clone();
  Adam opt(params, AdamOptions(0.1));
  params[0].mutable_grad() = torch::ones({5});
  int calls = 0;
  const Tensor loss = opt.step([&] {
    ++calls;
    EXPECT_TRUE(torch::GradMode::is_enabled());
    return torch::full({}, 3.0);
  });
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(loss.item<double>(), 3.0);
  EXPECT_TRUE(torch::equal(params[1].detach(), untouched));
  EXPECT_EQ(opt.state().size(), 1u);
  EXPECT_FALSE(opt.step().defined());
}

// ---- threads and SIMD paths -------------------------------------------------

// Shapes that cover every vector tail, plus ones big enough to be split
// between threads at odd places.
std::vector<std::vector<int64_t>> SplitShapes() {
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t n = 0; n <= 40; ++n) shapes.push_back({n});
  shapes.push_back({100003});
  shapes.push_back({257, 263});
  return shapes;
}

// Final parameters, and bf16 / fp16 copies, after kSteps steps of each
// optimizer kind (with most options on) under the current threads and ISA.
std::vector<Tensor> RunAllKinds(const std::vector<Tensor>& init) {
  std::vector<Tensor> out;
  const auto grads = RandomGrads(init, kSteps, 31);
  auto add_run =
      [&](const std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<Tensor>&)>&
              make,
          bool lowp_bf16) {
        const auto params = CloneParams(init);
        auto opt = make(params);
        std::vector<Tensor> copies;
        for (const Tensor& p : params) {
          copies.push_back(torch::empty(p.sizes(), lowp_bf16 ? torch::kBFloat16 : torch::kHalf));
        }
        for (const auto& g : grads) {
          SetGrads(params, g);
          if (auto* adam = dynamic_cast<Adam*>(opt.get())) {
            adam->step_with_lowp_copy(copies);
          } else {
            dynamic_cast<SGD*>(opt.get())->step_with_lowp_copy(copies);
          }
        }
        for (size_t i = 0; i < params.size(); ++i) {
          out.push_back(params[i].detach());
          out.push_back(copies[i].view(torch::kInt16).to(torch::kInt32));
        }
      };
  add_run(
      [](const std::vector<Tensor>& p) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<Adam>(p, AdamOptions(1e-2).weight_decay(0.1).amsgrad(true));
      },
      true);
  add_run(
      [](const std::vector<Tensor>& p) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<AdamW>(p, AdamWOptions(1e-2).maximize(true));
      },
      false);
  add_run(
      [](const std::vector<Tensor>& p) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<SGD>(
            p, SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.1));
      },
      true);
  add_run(
      [](const std::vector<Tensor>& p) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<SGD>(p,
                                     SGDOptions(0.1).momentum(0.5).dampening(0.2).maximize(true));
      },
      false);
  return out;
}

TEST(OptimKernelsTest, UpdatesReallyRunOnTheIntraOpThreads) {
  ThreadsAndIsaGuard guard;
  const int64_t n = 100003;
  at::set_num_threads(1);
  const auto one = k::chunks_for_testing(n);
  ASSERT_EQ(one.chunks.size(), 1u);
  EXPECT_EQ(one.chunks[0], std::make_pair(int64_t{0}, n));
  at::set_num_threads(2);
  const auto two = k::chunks_for_testing(n);
  EXPECT_EQ(two.num_threads, 2);
  ASSERT_EQ(two.chunks.size(), 2u);
  EXPECT_EQ(two.chunks[0].first, 0);
  EXPECT_EQ(two.chunks[0].second, two.chunks[1].first);
  EXPECT_EQ(two.chunks[0].second % 16, 0) << "chunks split at cache lines";
  EXPECT_EQ(two.chunks[1].second, n);
  // Below the grain everything runs on the caller.
  EXPECT_EQ(k::chunks_for_testing(1000).chunks.size(), 1u);
}

TEST(OptimKernelsTest, SameResultsForOneAndTwoThreads) {
  ThreadsAndIsaGuard guard;
  const auto init = RandomParams(SplitShapes(), 41);
  at::set_num_threads(1);
  const auto one = RunAllKinds(init);
  at::set_num_threads(2);
  ASSERT_EQ(at::get_num_threads(), 2);
  const auto two = RunAllKinds(init);
  ExpectBitwiseEqual(one, two, "1 vs 2 threads");
}

TEST(OptimKernelsTest, AllSimdPathsGiveBitwiseEqualResults) {
  ThreadsAndIsaGuard guard;
  const auto isas = SupportedIsas();
  ASSERT_EQ(isas.front(), k::Isa::kScalar);
  std::string ran;
  for (k::Isa isa : isas) ran += std::string(ran.empty() ? "" : ", ") + k::isa_name(isa);
  std::cout << "[ simd paths ] compared: " << ran << "\n";
#if defined(__x86_64__) || defined(__i386__)
  // A CPU with AVX2 must get the AVX2 path: only scalar here means the
  // vectorized kernels were not built or not detected.
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_GE(isas.size(), 2u) << "this CPU has AVX2 and FMA but only the scalar kernels ran";
  }
#endif
  const auto init = RandomParams(SplitShapes(), 42);
  UseIsa(k::Isa::kScalar);
  const auto scalar = RunAllKinds(init);
  for (k::Isa isa : isas) {
    if (isa == k::Isa::kScalar) continue;
    UseIsa(isa);
    ExpectBitwiseEqual(RunAllKinds(init), scalar, std::string(k::isa_name(isa)) + " vs scalar");
  }
  RecordProperty("simd_paths_compared", static_cast<int>(isas.size()));
}

TEST(OptimKernelsTest, IsaSelectionErrors) {
  ThreadsAndIsaGuard guard;
  EXPECT_THROW(k::select_isa("sse9"), c10::ValueError);
  setenv("ROUNDPIPE_SIMD", "bogus", 1);
  EXPECT_THROW(k::select_isa_from_env(), c10::ValueError);
  // Pretend the CPU has no SIMD: forcing one is an error, the default is scalar.
  k::set_max_isa_for_testing(k::Isa::kScalar);
  EXPECT_THROW(k::select_isa(k::Isa::kAvx2), c10::ValueError);
  setenv("ROUNDPIPE_SIMD", "avx512", 1);
  EXPECT_THROW(k::select_isa_from_env(), c10::ValueError);
  unsetenv("ROUNDPIPE_SIMD");
  EXPECT_EQ(k::select_isa_from_env(), k::Isa::kScalar);
  EXPECT_EQ(k::best_isa(), k::Isa::kScalar);
}

// ---- low precision and unscale ------------------------------------------------

TEST(OptimKernelsTest, LowpWriteBackEqualsTensorTo) {
  ThreadsAndIsaGuard guard;
  const auto init = RandomParams(SplitShapes(), 51);
  const auto grads = RandomGrads(init, 3, 52);
  for (k::Isa isa : SupportedIsas()) {
    UseIsa(isa);
    for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
      const auto pa = CloneParams(init);
      const auto ps = CloneParams(init);
      Adam adam(pa, AdamOptions(0.1));
      SGD sgd(ps, SGDOptions(0.1).momentum(0.9));
      std::vector<Tensor> ca, cs;
      for (const Tensor& p : init) {
        ca.push_back(torch::empty(p.sizes(), dtype));
        cs.push_back(torch::empty(p.sizes(), dtype));
      }
      for (const auto& g : grads) {
        SetGrads(pa, g);
        SetGrads(ps, g);
        adam.step_with_lowp_copy(ca);
        sgd.step_with_lowp_copy(cs);
        for (size_t i = 0; i < init.size(); ++i) {
          EXPECT_TRUE(
              torch::equal(ca[i].view(torch::kInt16), pa[i].detach().to(dtype).view(torch::kInt16)))
              << k::isa_name(isa) << " Adam " << dtype << " parameter " << i;
          EXPECT_TRUE(
              torch::equal(cs[i].view(torch::kInt16), ps[i].detach().to(dtype).view(torch::kInt16)))
              << k::isa_name(isa) << " SGD " << dtype << " parameter " << i;
        }
      }
    }
  }
}

// Values that exercise rounding: ties, subnormals, overflow, signed zeros,
// infinities, NaN, and random values over many magnitudes.
std::vector<float> SpecialValues() {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          1.0f + 0x1.0p-8f,
                          1.0f + 0x3.0p-8f,
                          1.0f + 0x1.0p-11f,
                          1.0f + 0x3.0p-11f,
                          65504.0f,
                          65519.0f,
                          65520.0f,
                          -65520.0f,
                          1e-8f,
                          -3e-8f,
                          0x1.0p-24f,
                          0x1.0p-25f,
                          0x1.8p-25f,
                          6e-5f,
                          1e-40f,
                          -1e-42f,
                          3.4e38f,
                          -3.4e38f,
                          inf,
                          -inf,
                          std::numeric_limits<float>::quiet_NaN(),
                          -std::numeric_limits<float>::quiet_NaN()};
  torch::manual_seed(61);
  const Tensor r = torch::randn({4000}) * torch::pow(2.0, torch::randint(-40, 40, {4000}));
  const float* data = r.data_ptr<float>();
  v.insert(v.end(), data, data + r.numel());
  return v;
}

TEST(OptimKernelsTest, ConversionMatchesC10BitForBit) {
  ThreadsAndIsaGuard guard;
  const std::vector<float> values = SpecialValues();
  const Tensor src = torch::tensor(values);
  const int64_t n = src.numel();
  for (k::Isa isa : SupportedIsas()) {
    UseIsa(isa);
    std::vector<uint16_t> bf16(n), fp16(n);
    k::convert_to_lowp(values.data(), bf16.data(), n, k::LowpKind::kBFloat16);
    k::convert_to_lowp(values.data(), fp16.data(), n, k::LowpKind::kFloat16);
    const Tensor to_bf16 = src.to(torch::kBFloat16);
    const Tensor to_fp16 = src.to(torch::kHalf);
    const c10::BFloat16* aten_bf16 = to_bf16.data_ptr<c10::BFloat16>();
    const c10::Half* aten_fp16 = to_fp16.data_ptr<c10::Half>();
    for (int64_t i = 0; i < n; ++i) {
      const float x = values[i];
      ASSERT_EQ(bf16[i], c10::BFloat16(x).x) << k::isa_name(isa) << " bf16 of " << x;
      ASSERT_EQ(fp16[i], c10::Half(x).x) << k::isa_name(isa) << " fp16 of " << x;
      if (!std::isnan(x)) {  // ATen's vectorized NaN encodings vary between versions
        ASSERT_EQ(bf16[i], aten_bf16[i].x) << "bf16 of " << x;
        ASSERT_EQ(fp16[i], aten_fp16[i].x) << "fp16 of " << x;
      }
    }
  }
}

TEST(OptimKernelsTest, UnscaleAndCheckFindsInfAndNan) {
  ThreadsAndIsaGuard guard;
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    for (k::Isa isa : SupportedIsas()) {
      UseIsa(isa);
      for (int64_t n : {0, 1, 15, 16, 17, 1000, 100003}) {
        const Tensor g = torch::randn({n});
        Tensor a = g.clone();
        EXPECT_FALSE(k::unscale_and_check(a.data_ptr<float>(), n, 0.25f));
        EXPECT_TRUE(torch::equal(a, g * 0.25f)) << n;
        a = g.clone();
        EXPECT_FALSE(k::unscale_and_check(a.data_ptr<float>(), n, 1.0f));
        EXPECT_TRUE(torch::equal(a, g));
        if (n == 0) continue;
        for (int64_t pos : {int64_t{0}, n / 2, n - 1}) {
          for (float bad : {inf, -inf, nan}) {
            a = g.clone();
            a[pos] = bad;
            const Tensor expected = a * 0.5f;
            EXPECT_TRUE(k::unscale_and_check(a.data_ptr<float>(), n, 0.5f))
                << k::isa_name(isa) << " n=" << n << " pos=" << pos << " value=" << bad;
            EXPECT_TRUE(torch::equal(a.nan_to_num(0.0), expected.nan_to_num(0.0)));
          }
        }
        a = g.clone();
        a[n - 1] = std::numeric_limits<float>::max();  // large but finite
        EXPECT_FALSE(k::unscale_and_check(a.data_ptr<float>(), n, 1.0f));
      }
    }
  }
}

// ---- state dicts -----------------------------------------------------------

template <typename Opt, typename Options>
void CheckRoundTrip(const Options& options, const std::string& what) {
  const auto init = RandomParams(kGridShapes, 71);
  const auto grads = RandomGrads(init, 2 * kSteps, 72);
  const std::vector<std::vector<Tensor>> first(grads.begin(), grads.begin() + kSteps);
  const std::vector<std::vector<Tensor>> second(grads.begin() + kSteps, grads.end());

  const auto a = CloneParams(init);
  Opt opt_a(a, options);
  RunSteps(a, first, [&] { opt_a.step(); });
  std::stringstream stream;
  torch::save(opt_a, stream);

  const auto b = CloneParams(a);
  Opt opt_b(b, options);
  torch::load(opt_b, stream);
  EXPECT_EQ(opt_b.state().size(), opt_a.state().size()) << what;
  RunSteps(a, second, [&] { opt_a.step(); });
  RunSteps(b, second, [&] { opt_b.step(); });
  ExpectBitwiseEqual(a, b, what + " after save/load");
}

TEST(OptimAdamTest, StateDictRoundTrip) {
  CheckRoundTrip<Adam>(AdamOptions(0.05).amsgrad(true).weight_decay(0.1).maximize(true), "Adam");
  CheckRoundTrip<AdamW>(AdamWOptions(0.05), "AdamW");
}

TEST(OptimSGDTest, StateDictRoundTrip) {
  CheckRoundTrip<SGD>(SGDOptions(0.1).momentum(0.9).dampening(0.1), "SGD");
}

TEST(OptimAdamTest, StateLooksLikeLibtorchsAndArchivesInterchange) {
  const auto init = RandomParams(kGridShapes, 81);
  const auto grads = RandomGrads(init, 2 * kSteps, 82);
  const std::vector<std::vector<Tensor>> first(grads.begin(), grads.begin() + kSteps);
  const std::vector<std::vector<Tensor>> second(grads.begin() + kSteps, grads.end());
  const AdamOptions o = AdamOptions(0.01).amsgrad(true);

  // libtorch's archive into ours: continuing matches libtorch.
  const auto t = CloneParams(init);
  torch::optim::Adam torch_opt(t, TorchAdamOptions(o));
  RunSteps(t, first, [&] { torch_opt.step(); });
  std::stringstream torch_stream;
  torch::save(torch_opt, torch_stream);
  const auto ours = CloneParams(t);
  Adam opt(ours, o);
  torch::load(opt, torch_stream);
  for (const Tensor& p : ours) {
    const auto& state =
        static_cast<const torch::optim::AdamParamState&>(*opt.state().at(detail::state_key(p)));
    EXPECT_EQ(state.step(), kSteps);
    EXPECT_TRUE(state.max_exp_avg_sq().defined());
  }
  RunSteps(t, second, [&] { torch_opt.step(); });
  RunSteps(ours, second, [&] { opt.step(); });
  ExpectClose(ours, t, kRtol * 1e-2, "libtorch archive loaded into roundpipe Adam");

  // Ours into libtorch's: loads and continues the same way.
  std::stringstream our_stream;
  torch::save(opt, our_stream);
  const auto t2 = CloneParams(ours);
  torch::optim::Adam torch_opt2(t2, TorchAdamOptions(o));
  torch::load(torch_opt2, our_stream);
  RunSteps(t2, first, [&] { torch_opt2.step(); });
  RunSteps(ours, first, [&] { opt.step(); });
  ExpectClose(ours, t2, kRtol * 1e-2, "roundpipe archive loaded into torch::optim::Adam");
}

// ---- errors ---------------------------------------------------------------

TEST(OptimAdamTest, RejectsBadParameters) {
  const Tensor good = torch::randn({4});
  testing::expect_message(testing::error_of<c10::TypeError>([&] {
                  Adam({good, torch::randn({3}, torch::kDouble)});
                }),
                {"Adam: parameter 1 (group 0, position 1)", "float32", "Double"});
  testing::expect_message(testing::error_of<c10::TypeError>([&] { AdamW({torch::randn({3}, torch::kHalf)}); }),
                {"AdamW: parameter 0", "float32"});
  testing::expect_message(testing::error_of<c10::ValueError>([&] {
                  Adam({torch::randn({3, 4}).t()});
                }),
                {"parameter 0", "contiguous"});
  // Index over all groups.
  std::vector<torch::optim::OptimizerParamGroup> groups = {
      torch::optim::OptimizerParamGroup({good, torch::randn({2})}),
      torch::optim::OptimizerParamGroup({torch::randn({2, 2}).t()})};
  testing::expect_message(testing::error_of<c10::ValueError>([&] { Adam(groups, AdamOptions()); }),
                {"parameter 2 (group 1, position 0)", "contiguous"});
  testing::expect_message(
      testing::error_of<c10::TypeError>([&] {
        std::vector<torch::optim::OptimizerParamGroup> g = {torch::optim::OptimizerParamGroup(
            {good}, std::make_unique<torch::optim::AdamOptions>(1e-3))};
        Adam opt(g, AdamOptions());
      }),
      {"group 0", "roundpipe::optim::AdamOptions"});
}

TEST(OptimAdamTest, RejectsBadGradientsWithoutChangingAnything) {
  auto params = RandomParams({{4}, {3, 4}}, 91);
  const Tensor before0 = params[0].detach().clone();
  Adam opt(params, AdamOptions(0.1));
  params[0].mutable_grad() = torch::ones({4});
  params[1].mutable_grad() = torch::ones({4, 3}).t();  // right shape, not contiguous
  testing::expect_message(testing::error_of<c10::ValueError>([&] { opt.step(); }),
                {"parameter 1", "gradient", "contiguous"});
  EXPECT_TRUE(torch::equal(params[0].detach(), before0));
  EXPECT_TRUE(opt.state().empty());
  params[1].mutable_grad() =
      torch::sparse_coo_tensor(torch::zeros({2, 1}, torch::kLong), torch::ones({1}), {3, 4});
  testing::expect_message(testing::error_of<c10::TypeError>([&] { opt.step(); }), {"parameter 1", "gradient", "dense"});
  params[1].mutable_grad() = torch::ones({12});  // same numel, other shape
  testing::expect_message(testing::error_of<c10::ValueError>([&] { opt.step(); }), {"parameter 1", "sizes [12]"});
  EXPECT_TRUE(opt.state().empty());
}

TEST(OptimAdamTest, RejectsBadOptions) {
  const std::vector<Tensor> p = {torch::randn({2})};
  auto value_error = [&](const AdamOptions& o) {
    return testing::error_of<c10::ValueError>([&] { Adam opt(p, o); });
  };
  testing::expect_message(value_error(AdamOptions(-1)), {"learning rate"});
  testing::expect_message(value_error(AdamOptions().betas({1.0, 0.9})), {"beta", "index 0"});
  testing::expect_message(value_error(AdamOptions().betas({0.9, -0.1})), {"beta", "index 1"});
  testing::expect_message(value_error(AdamOptions().eps(-1e-8)), {"epsilon"});
  testing::expect_message(value_error(AdamOptions().weight_decay(-0.1)), {"weight_decay"});
  testing::expect_message(value_error(AdamOptions(std::nan(""))), {"learning rate"});
  // Options changed after construction are checked at step().
  Adam opt(p, AdamOptions());
  p[0].mutable_grad() = torch::ones({2});
  static_cast<AdamOptions&>(opt.param_groups()[0].options()).lr(-1);
  testing::expect_message(testing::error_of<c10::ValueError>([&] { opt.step(); }), {"learning rate", "group 0"});
}

TEST(OptimSGDTest, RejectsBadOptionsAndParameters) {
  const std::vector<Tensor> p = {torch::randn({2})};
  auto value_error = [&](const SGDOptions& o) {
    return testing::error_of<c10::ValueError>([&] { SGD opt(p, o); });
  };
  testing::expect_message(value_error(SGDOptions(-0.1)), {"learning rate"});
  testing::expect_message(value_error(SGDOptions(0.1).momentum(-1)), {"momentum"});
  testing::expect_message(value_error(SGDOptions(0.1).weight_decay(-1)), {"weight_decay"});
  testing::expect_message(value_error(SGDOptions(0.1).nesterov(true)), {"Nesterov"});
  testing::expect_message(value_error(SGDOptions(0.1).nesterov(true).momentum(0.9).dampening(0.1)),
                {"Nesterov"});
  testing::expect_message(testing::error_of<c10::TypeError>([&] { SGD({torch::randn({2}, torch::kDouble)}, 0.1); }),
                {"SGD: parameter 0", "float32"});
  testing::expect_message(testing::error_of<c10::TypeError>([&] { SGD({torch::randn({2}).to_sparse()}, 0.1); }),
                {"SGD: parameter 0", "dense"});
}

TEST(OptimSGDTest, RejectsBadLowpCopies) {
  auto params = RandomParams({{4}, {3}}, 95);
  SGD opt(params, SGDOptions(0.1));
  for (const Tensor& p : params) p.mutable_grad() = torch::ones(p.sizes());
  testing::expect_message(testing::error_of<c10::ValueError>([&] { opt.step_with_lowp_copy({Tensor()}); }),
                {"1 low-precision copies for 2 parameters"});
  testing::expect_message(testing::error_of<c10::TypeError>([&] {
                  opt.step_with_lowp_copy({Tensor(), torch::empty({3})});
                }),
                {"parameter 1", "bfloat16 or float16"});
  testing::expect_message(testing::error_of<c10::ValueError>([&] {
                  opt.step_with_lowp_copy({Tensor(), torch::empty({4}, torch::kBFloat16)});
                }),
                {"parameter 1", "4 elements"});
  // Undefined entries: no copy, still an update.
  const Tensor before = params[0].detach().clone();
  opt.step_with_lowp_copy({Tensor(), Tensor()});
  EXPECT_FALSE(torch::equal(params[0].detach(), before));
}

}  // namespace
}  // namespace optim
}  // namespace roundpipe
