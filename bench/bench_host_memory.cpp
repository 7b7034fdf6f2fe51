// B7: resident host bytes per byte of parameters for a RoundPipe model
// (parameters in per-layer arenas), excluding the optimizer copies; where
// the devices are CUDA devices, also the page-locked bytes per byte.
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "bench_common.h"
#include "runtime/cuda_memory.h"

using namespace roundpipe;

// Resident set size of this process, from /proc/self/statm.
int64_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * 4096;
}

int main() {
  constexpr int64_t kLayers = 16, kWidth = 1024;  // 16 x 4 MiB of fp32 weights
  std::printf("B7 host memory — %s\n", bench::machine_line().c_str());
  torch::manual_seed(0);
  get_num_devices();  // start the pool and its threads before measuring
  {
    // The engine's process-wide set-up (its dispatcher kernels, registered
    // once when the first model is made) is not the model's memory.
    torch::nn::Sequential tiny(torch::nn::Linear(2, 2));
    RoundPipe warm_up(tiny);
  }
  const bool cuda_pool = get_device_names().front().rfind("cuda", 0) == 0;
  const int64_t before = rss_bytes(), locked_before = cuda_pool ? cuda::page_locked_host_bytes() : 0;
  int64_t param_bytes = 0, optim_bytes = 0, after = 0, locked = 0;
  {
    torch::nn::Sequential net;
    for (int64_t i = 0; i < kLayers; ++i) net->push_back(torch::nn::Linear(kWidth, kWidth));
    for (const auto& p : net->parameters()) param_bytes += p.numel() * p.element_size();
    RoundPipe model(net);
    for (const auto& p : model.optim_parameters()) optim_bytes += p.numel() * p.element_size();
    after = rss_bytes();
    if (cuda_pool) {
      // Page-locked memory as training leaves it: the slab and the pinned
      // blocks gradient downloads were staged in.
      LossFn loss_fn = [](const c10::IValue& out, const c10::IValue&) -> c10::IValue {
        return out.toTensor().square().mean();
      };
      model.forward_backward({torch::randn({64, kWidth})}, make_kwargs(), c10::IValue(), loss_fn, false,
                             RunConfig().num_microbatch(4));
      model.synchronize();
      locked = cuda::page_locked_host_bytes() - locked_before;
    }
  }
  const double host = static_cast<double>(after - before - optim_bytes);
  std::printf("parameters %.1f MiB, optimizer copies %.1f MiB, resident growth %.1f MiB\n",
              param_bytes / 1048576.0, optim_bytes / 1048576.0, (after - before) / 1048576.0);
  char pinned[64] = "";
  if (cuda_pool) {
    std::snprintf(pinned, sizeof pinned, " pinned_bytes_per_param_byte=%.3f", static_cast<double>(locked) / param_bytes);
  }
  std::printf("RESULT id=B7 host_bytes_per_param_byte=%.3f%s param_mib=%.1f\n", host / param_bytes, pinned,
              param_bytes / 1048576.0);
  return 0;
}
