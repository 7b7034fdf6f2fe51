// B6: peak bytes per device for 8, 32 and 64 equal layers in one-layer
// stages: device memory must not grow with depth.
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

#include <cstdio>
#include <utility>
#include <cstdlib>

#include "bench_common.h"

using namespace roundpipe;

// The peak bytes in use on any device, and held from it (cached included).
std::pair<int64_t, int64_t> peak_bytes(int64_t layers) {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int64_t i = 0; i < layers; ++i) net->push_back(torch::nn::Linear(512, 512));
  RoundPipe model(net);
  ModelExecutePlan plan;
  for (int64_t l = 0; l + 1 < layers; ++l) plan.fwd_plan.push_back({l, l + 1});
  for (int64_t l = layers - 1; l >= 0; --l) plan.bwd_plan.push_back({l, l + 1});
  RunConfig cfg = RunConfig().execute_plan(plan);
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue&) -> c10::IValue { return out.toTensor().square().mean(); };
  at::Tensor x = torch::randn({64, 512});
  model.forward_backward({x}, make_kwargs(), c10::IValue(), loss_fn, false, cfg);
  reset_peak_device_memory();
  model.forward_backward({x}, make_kwargs(), c10::IValue(), loss_fn, false, cfg);
  int64_t peak = 0, reserved = 0;
  for (const auto& s : device_memory_stats()) {
    peak = std::max(peak, s.max_allocated_bytes);
    reserved = std::max(reserved, s.max_reserved_bytes);
  }
  return {peak, reserved};
}

int main() {
  std::printf("B6 device memory vs depth — %s\n", bench::machine_line().c_str());
  const char* delay_env = std::getenv("ROUNDPIPE_CPU_COPY_DELAY_US");
  const long long copy_delay_us = delay_env != nullptr && *delay_env != '\0' ? std::atoll(delay_env) : 0;
  std::printf("devices %lld, Linear(512, 512) layers (1 MiB of parameters each), one-layer stages, "
              "CPU copies complete %lld us after they are issued\n",
              (long long)get_num_devices(), copy_delay_us);
  std::printf("%8s %16s\n", "layers", "peak MiB/device");
  int64_t p8 = 0, p32 = 0, p64 = 0, reserved64 = 0;
  for (int64_t layers : {8, 32, 64}) {
    auto [p, reserved] = peak_bytes(layers);
    if (layers == 64) reserved64 = reserved;
    (layers == 8 ? p8 : layers == 32 ? p32 : p64) = p;
    std::printf("%8lld %16.2f\n", (long long)layers, p / 1048576.0);
  }
  std::printf("RESULT id=B6 peak64_vs_peak8=%.3f peak32_vs_peak8=%.3f peak8_mib=%.2f peak64_mib=%.2f "
              "reserved64_mib=%.2f copy_delay_us=%lld\n",
              double(p64) / p8, double(p32) / p8, p8 / 1048576.0, p64 / 1048576.0, reserved64 / 1048576.0,
              copy_delay_us);
  return 0;
}
