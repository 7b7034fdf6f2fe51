// B1: roundpipe's CPU Adam / AdamW / SGD against (a) a hand-written
// multithreaded STREAM triad measured in the same process (the memory-bandwidth
// limit) and (b) torch's fused CPU optimizers (the kernels behind
// torch.optim.Adam/AdamW/SGD(..., fused=True)) on equal tensors, and Adam
// with bf16 and 8-bit blockwise states against fp32 Adam (time per element,
// adam_compact_vs_fp32 and adam8bit_vs_fp32). Every
// repetition runs all kernels once, in a fixed order (strict alternation); the
// table shows medians after one warm-up round.
//
// Environment (defaults = the size B1 runs, docs/guide.md):
//   ROUNDPIPE_B1_ELEMENTS  total fp32 parameter elements (default 64Mi)
//   ROUNDPIPE_B1_TENSORS   number of equal tensors (default 16)
//   ROUNDPIPE_B1_REPS      timed repetitions, >= 5 (default 9)
//   ROUNDPIPE_B1_THREADS   threads for every side: intra-op threads, triad threads
//                          (default: all cores)
//   ROUNDPIPE_SIMD         force roundpipe's kernels: scalar | avx2 | avx512
#include <ATen/Parallel.h>
#include <malloc.h>
#include <roundpipe/optim/adam.h>
#include <roundpipe/optim/sgd.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "optim/kernels/kernels.h"

namespace {

using roundpipe::bench::median;
using roundpipe::bench::seconds;

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' ? fallback : std::stoll(v);
}

struct Kernel {
  std::string name;
  double bytes_per_element;  // nominal traffic per counted element
  int64_t elements;
  std::function<void()> run;
  int torch_peer = -1;  // index of the torch kernel it is compared with
  std::vector<double> times;
};

// STREAM triad a = b + s * c over `threads` threads, each on its own
// contiguous chunk: plain loops the compiler vectorizes, no library between
// the loop and memory.
// Vectorized (GCC's -O2 cost model leaves this loop scalar).
__attribute__((optimize("tree-vectorize", "vect-cost-model=dynamic"))) void triad_chunk(
    float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ c, float s,
    int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

void triad(float* a, const float* b, const float* c, float s, int64_t n, int64_t threads) {
  std::vector<std::thread> pool;
  const int64_t chunk = (n + threads - 1) / threads;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t begin = t * chunk, end = std::min(n, begin + chunk);
    pool.emplace_back([=] { triad_chunk(a, b, c, s, begin, end); });
  }
  for (auto& th : pool) th.join();
}

// torch's fused CPU Adam / AdamW (what torch.optim.Adam(fused=True).step()
// runs: the step counters, then one fused kernel) on its own state.
struct TorchFusedAdam {
  std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq, steps;
  bool decoupled;
  TorchFusedAdam(const std::vector<at::Tensor>& p, bool adamw) : decoupled(adamw) {
    for (const auto& t : p) {
      params.push_back(t.detach());
      grads.push_back(t.grad());
      exp_avg.push_back(at::zeros_like(t));
      exp_avg_sq.push_back(at::zeros_like(t));
      steps.push_back(at::zeros({}, at::kFloat));
    }
  }
  void step() {
    at::_foreach_add_(steps, 1);
    if (decoupled) {
      at::_fused_adamw_(params, grads, exp_avg, exp_avg_sq, {}, steps, 1e-4, 0.9, 0.999, 1e-2, 1e-8,
                        false, false);
    } else {
      at::_fused_adam_(params, grads, exp_avg, exp_avg_sq, {}, steps, 1e-4, 0.9, 0.999, 0.0, 1e-8,
                       false, false);
    }
  }
};

// torch's fused CPU SGD with momentum (torch.optim.SGD(fused=True)).
struct TorchFusedSgd {
  std::vector<at::Tensor> params, grads, momentum;
  bool first = true;
  explicit TorchFusedSgd(const std::vector<at::Tensor>& p) {
    for (const auto& t : p) {
      params.push_back(t.detach());
      grads.push_back(t.grad());
      momentum.push_back(at::zeros_like(t));
    }
  }
  void step() {
    at::_fused_sgd_(params, grads, momentum, 0.0, 0.9, 1e-4, 0.0, false, false, first);
    first = false;
  }
};

}  // namespace

int main() {
  // Same allocator settings for both sides: keep big blocks on the heap and
  // never return them, so neither side re-faults fresh pages every step.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, -1);

  const int64_t total = env_int("ROUNDPIPE_B1_ELEMENTS", int64_t{64} << 20);
  const int64_t num_tensors = env_int("ROUNDPIPE_B1_TENSORS", 16);
  const int64_t reps = std::max<int64_t>(5, env_int("ROUNDPIPE_B1_REPS", 9));
  const int64_t threads =
      env_int("ROUNDPIPE_B1_THREADS", static_cast<int64_t>(std::thread::hardware_concurrency()));
  at::set_num_threads(static_cast<int>(threads));
  torch::NoGradGuard no_grad;

  const int64_t per_tensor = total / num_tensors;
  const int64_t n = per_tensor * num_tensors;
  std::vector<torch::Tensor> params, lowp;
  for (int64_t i = 0; i < num_tensors; ++i) {
    params.push_back(torch::rand({per_tensor}).requires_grad_(true));
    params.back().mutable_grad() = torch::randn({per_tensor}).mul_(1e-2);
    lowp.push_back(torch::empty({per_tensor}, torch::kBFloat16));
  }
  // Triad arrays sized so that one triad pass moves what one Adam step moves.
  const int64_t triad_n = n * 28 / 12;
  std::vector<float> ta(triad_n, 0.0f), tb(triad_n, 1.0f), tc(triad_n, 2.0f);

  // torch's kernels run on their own copies (same values), so both sides
  // update state of the same size.
  std::vector<torch::Tensor> torch_params;
  for (const auto& p : params) {
    torch_params.push_back(p.detach().clone().requires_grad_(true));
    torch_params.back().mutable_grad() = p.grad().clone();
  }
  roundpipe::optim::Adam adam(params, roundpipe::optim::AdamOptions(1e-4));
  TorchFusedAdam torch_adam(torch_params, /*adamw=*/false);
  roundpipe::optim::AdamW adamw(params, roundpipe::optim::AdamWOptions(1e-4));
  TorchFusedAdam torch_adamw(torch_params, /*adamw=*/true);
  roundpipe::optim::Adam adam_bf16(params, roundpipe::optim::AdamOptions(1e-4));
  roundpipe::optim::Adam adam_bf16_states(params, roundpipe::optim::AdamOptions(1e-4).state_dtype(
                                                      roundpipe::optim::StateDtype::kBFloat16));
  roundpipe::optim::Adam adam_8bit_states(params, roundpipe::optim::AdamOptions(1e-4).state_dtype(
                                                      roundpipe::optim::StateDtype::kBlockwise8));
  roundpipe::optim::SGD sgd(params, roundpipe::optim::SGDOptions(1e-4).momentum(0.9));
  TorchFusedSgd torch_sgd(torch_params);

  std::vector<Kernel> kernels;
  // Rows: name, counted bytes per element, elements, index of the torch row
  // it is compared with (-1: none), the work.
  auto add = [&](const char* name, double bytes, int64_t elements, int torch_peer,
                 std::function<void()> run) {
    kernels.push_back({name, bytes, elements, std::move(run), torch_peer, {}});
  };
  add("triad a=b+s*c (threads)", 12, triad_n, -1,
      [&] { triad(ta.data(), tb.data(), tc.data(), 3.0f, triad_n, threads); });
  add("roundpipe Adam", 28, n, 2, [&] { adam.step(); });                                     // 1
  add("torch fused Adam", 28, n, -1, [&] { torch_adam.step(); });                            // 2
  add("roundpipe AdamW", 28, n, 4, [&] { adamw.step(); });                                   // 3
  add("torch fused AdamW", 28, n, -1, [&] { torch_adamw.step(); });                          // 4
  add("roundpipe SGD m=0.9", 20, n, 6, [&] { sgd.step(); });                                 // 5
  add("torch fused SGD m=0.9", 20, n, -1, [&] { torch_sgd.step(); });                        // 6
  add("roundpipe Adam+bf16 copy", 30, n, -1, [&] { adam_bf16.step_with_lowp_copy(lowp); });  // 7
  add("roundpipe Adam bf16 states", 20, n, -1, [&] { adam_bf16_states.step(); });            // 8
  add("roundpipe Adam 8bit states", 16.0625, n, -1, [&] { adam_8bit_states.step(); });      // 9

  std::printf("B1 optimizer step: %lld fp32 elements in %lld tensors, %lld reps (median)\n",
              static_cast<long long>(n), static_cast<long long>(num_tensors),
              static_cast<long long>(reps));
  std::printf("%s\n", roundpipe::bench::machine_line().c_str());
  std::printf(
      "allocator: mallopt(M_MMAP_THRESHOLD, 1<<30) and mallopt(M_TRIM_THRESHOLD, -1) for both "
      "sides; intra-op threads %d for every kernel; roundpipe SIMD: %s\n",
      at::get_num_threads(),
      roundpipe::optim::kernels::isa_name(roundpipe::optim::kernels::active_isa()));
  std::printf(
      "bytes per element (GB/s column): Adam 28 (rd p,g,m,v; wr p,m,v), +2 with a bf16 copy, "
      "20 with bf16 states, 16.0625 with 8-bit states (+ 2 absmax floats per 256), "
      "SGD+momentum 20; triad 12 (STREAM convention, write-allocate not counted) over %lld "
      "elements, %lld threads\n"
      "torch fused: at::_fused_adam_ / _fused_adamw_ / _fused_sgd_ of torch %s (the step counters "
      "incremented first, as torch.optim does)\n",
      static_cast<long long>(triad_n), static_cast<long long>(threads), TORCH_VERSION);
  std::fflush(stdout);

  for (int64_t rep = 0; rep <= reps; ++rep) {  // rep 0: warm-up (state, page faults)
    for (Kernel& k : kernels) {
      const double t = seconds(k.run);
      if (rep > 0) k.times.push_back(t);
    }
  }

  const double triad_gbps = 12.0 * triad_n / median(kernels[0].times) / 1e9;
  std::printf("\n| %-26s | %9s | %8s | %7s | %8s | %11s |\n", "kernel", "ms", "ns/elem", "GB/s",
              "vs triad", "vs torch");
  std::printf("|%s|%s|%s|%s|%s|%s|\n", std::string(28, '-').c_str(), std::string(11, '-').c_str(),
              std::string(10, '-').c_str(), std::string(9, '-').c_str(),
              std::string(10, '-').c_str(), std::string(13, '-').c_str());
  std::vector<double> gbps(kernels.size()), speedup(kernels.size(), 0);
  for (size_t i = 0; i < kernels.size(); ++i) {
    const Kernel& k = kernels[i];
    const double t = median(k.times);
    gbps[i] = k.bytes_per_element * k.elements / t / 1e9;
    char vs_torch[32] = "";
    if (k.torch_peer >= 0) {
      speedup[i] = median(kernels[k.torch_peer].times) / t;
      std::snprintf(vs_torch, sizeof(vs_torch), "%.2fx", speedup[i]);
    }
    std::printf("| %-26s | %9.2f | %8.3f | %7.2f | %8.3f | %11s |\n", k.name.c_str(), t * 1e3,
                t * 1e9 / k.elements, gbps[i], gbps[i] / triad_gbps, vs_torch);
  }
  std::printf(
      "\nRESULT id=B1 adam_vs_triad=%.3f adam_vs_torch_fused=%.2f adamw_vs_torch_fused=%.2f "
      "sgd_vs_torch_fused=%.2f adam_bf16_vs_triad=%.3f sgd_vs_triad=%.3f triad_gbps=%.2f "
      "adam_gbps=%.2f "
      "threads=%d isa=%s torch=%s adam_compact_vs_fp32=%.3f adam8bit_vs_fp32=%.3f\n",
      gbps[1] / triad_gbps, speedup[1], speedup[3], speedup[5], gbps[7] / triad_gbps,
      gbps[5] / triad_gbps, triad_gbps, gbps[1], at::get_num_threads(),
      roundpipe::optim::kernels::isa_name(roundpipe::optim::kernels::active_isa()), TORCH_VERSION,
      median(kernels[8].times) / median(kernels[1].times),
      median(kernels[9].times) / median(kernels[1].times));
  return 0;
}
