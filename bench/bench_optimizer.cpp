// B1: roundpipe's CPU Adam / AdamW / SGD against (a) a STREAM triad measured in
// the same process (the memory-bandwidth limit) and (b) libtorch's optimizers
// on the same tensors. Every repetition runs all kernels once, in a fixed
// order (strict alternation); the table shows medians after one warm-up round.
//
// Environment (defaults = the BENCHMARKS.md size):
//   ROUNDPIPE_B1_ELEMENTS  total fp32 parameter elements (default 64Mi)
//   ROUNDPIPE_B1_TENSORS   number of equal tensors (default 16)
//   ROUNDPIPE_B1_REPS      timed repetitions, >= 5 (default 9)
//   ROUNDPIPE_B1_THREADS   intra-op threads for every side (default: all cores)
//   ROUNDPIPE_SIMD         force roundpipe's kernels: scalar | avx2 | avx512
#include <ATen/Parallel.h>
#include <malloc.h>
#include <roundpipe/optim/adam.h>
#include <roundpipe/optim/sgd.h>
#include <torch/torch.h>

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
  int torch_peer = -1;  // index of the libtorch kernel it is compared with
  std::vector<double> times;
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
  torch::Tensor ta = torch::zeros({triad_n}), tb = torch::ones({triad_n}),
                tc = torch::full({triad_n}, 2.0f);

  roundpipe::optim::Adam adam(params, roundpipe::optim::AdamOptions(1e-4));
  torch::optim::Adam torch_adam(params, torch::optim::AdamOptions(1e-4));
  roundpipe::optim::AdamW adamw(params, roundpipe::optim::AdamWOptions(1e-4));
  torch::optim::AdamW torch_adamw(params, torch::optim::AdamWOptions(1e-4));
  roundpipe::optim::Adam adam_bf16(params, roundpipe::optim::AdamOptions(1e-4));
  roundpipe::optim::SGD sgd(params, roundpipe::optim::SGDOptions(1e-4).momentum(0.9));
  torch::optim::SGD torch_sgd(params, torch::optim::SGDOptions(1e-4).momentum(0.9));
  // The common recipe (e.g. ResNet): momentum plus weight decay.
  roundpipe::optim::SGD sgd_wd(params,
                               roundpipe::optim::SGDOptions(1e-4).momentum(0.9).weight_decay(1e-4));
  torch::optim::SGD torch_sgd_wd(params,
                                 torch::optim::SGDOptions(1e-4).momentum(0.9).weight_decay(1e-4));

  std::vector<Kernel> kernels;
  // Rows: name, counted bytes per element, elements, index of the libtorch row
  // it is compared with (-1: none), the work.
  auto add = [&](const char* name, double bytes, int64_t elements, int torch_peer,
                 std::function<void()> run) {
    kernels.push_back({name, bytes, elements, std::move(run), torch_peer, {}});
  };
  // STREAM triad a = b + s * c: libtorch's vectorized add with alpha, run on
  // the same intra-op pool as everything else (at::parallel_for itself is
  // serial in code built without -fopenmp, such as this file).
  add("triad a=b+s*c", 12, triad_n, -1, [&] { at::add_out(ta, tb, tc, 3.0); });
  add("roundpipe Adam", 28, n, 2, [&] { adam.step(); });                                     // 1
  add("libtorch Adam", 28, n, -1, [&] { torch_adam.step(); });                               // 2
  add("roundpipe AdamW", 28, n, 4, [&] { adamw.step(); });                                   // 3
  add("libtorch AdamW", 28, n, -1, [&] { torch_adamw.step(); });                             // 4
  add("roundpipe SGD m=0.9", 20, n, 6, [&] { sgd.step(); });                                 // 5
  add("libtorch SGD m=0.9", 20, n, -1, [&] { torch_sgd.step(); });                           // 6
  add("roundpipe SGD m=0.9 wd", 20, n, 8, [&] { sgd_wd.step(); });                           // 7
  add("libtorch SGD m=0.9 wd", 20, n, -1, [&] { torch_sgd_wd.step(); });                     // 8
  add("roundpipe Adam+bf16 copy", 30, n, -1, [&] { adam_bf16.step_with_lowp_copy(lowp); });  // 9

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
      "SGD+momentum 20; triad 12 (STREAM convention, write-allocate not counted) over %lld "
      "elements\n"
      "libtorch's passes move about: Adam 80, AdamW 88, SGD+momentum 32, SGD+momentum+wd 44 "
      "B/element, which bounds a one-pass kernel's speedup at ~2.9x, 3.1x, 1.6x, 2.2x\n",
      static_cast<long long>(triad_n));
  std::fflush(stdout);

  for (int64_t rep = 0; rep <= reps; ++rep) {  // rep 0: warm-up (state, page faults)
    for (Kernel& k : kernels) {
      const double t = seconds(k.run);
      if (rep > 0) k.times.push_back(t);
    }
  }

  const double triad_gbps = 12.0 * triad_n / median(kernels[0].times) / 1e9;
  std::printf("\n| %-26s | %9s | %8s | %7s | %8s | %11s |\n", "kernel", "ms", "ns/elem", "GB/s",
              "vs triad", "vs libtorch");
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
      "\nRESULT id=B1 adam_vs_triad=%.3f adam_vs_torch=%.2f adamw_vs_torch=%.2f "
      "sgd_vs_torch=%.2f sgd_wd_vs_torch=%.2f adam_bf16_vs_triad=%.3f sgd_vs_triad=%.3f "
      "triad_gbps=%.2f adam_gbps=%.2f threads=%d isa=%s\n",
      gbps[1] / triad_gbps, speedup[1], speedup[3], speedup[5], speedup[7], gbps[9] / triad_gbps,
      gbps[5] / triad_gbps, triad_gbps, gbps[1], at::get_num_threads(),
      roundpipe::optim::kernels::isa_name(roundpipe::optim::kernels::active_isa()));
  return 0;
}
