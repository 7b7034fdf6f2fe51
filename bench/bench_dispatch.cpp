// B2: per (stage, microbatch) task overhead. 64 tiny layers in one-layer
// stages on two devices, 3 microbatches, forward_backward; against a plain
// libtorch loop doing the same microbatches with the same recomputation.
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

#include <cstdio>

#include "bench_common.h"

using namespace roundpipe;

int main() {
  constexpr int64_t kLayers = 64, kWidth = 8, kBatch = 6, kMicro = 3, kWarmup = 5, kReps = 21;
  torch::manual_seed(0);
  torch::nn::Sequential net, ref;
  for (int64_t i = 0; i < kLayers; ++i) net->push_back(torch::nn::Linear(kWidth, kWidth));
  for (int64_t i = 0; i < kLayers; ++i) ref->push_back(torch::nn::Linear(kWidth, kWidth));
  RoundPipe model(net, RoundPipeOptions().set_name("b2"));
  ModelExecutePlan plan;
  for (int64_t l = 0; l + 1 < kLayers; ++l) plan.fwd_plan.push_back({l, l + 1});
  for (int64_t l = kLayers - 1; l >= 0; --l) plan.bwd_plan.push_back({l, l + 1});
  const int64_t tasks = static_cast<int64_t>(plan.fwd_plan.size() + plan.bwd_plan.size()) * kMicro;
  RunConfig cfg = RunConfig().num_microbatch(kMicro).execute_plan(plan);
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue&) -> c10::IValue { return out.toTensor().sum(); };
  at::Tensor x = torch::randn({kBatch, kWidth});
  // The baseline runs where the pool's devices are: on a GPU pool, a plain
  // loop on that GPU (dispatching kernels there), waited for at its end.
  const bool on_gpu = get_device_names().front().rfind("cuda", 0) == 0;
  const at::Device plain_device = on_gpu ? at::Device(get_device_names().front()) : at::Device(at::kCPU);
  ref->to(plain_device);
  const at::Tensor x_plain = x.to(plain_device);

  auto run_roundpipe = [&] { model.forward_backward({x}, make_kwargs(), c10::IValue(), loss_fn, false, cfg); };
  // Plain loop: forward without graph (keeping each layer's input), then per
  // layer recompute with grad and backward, as roundpipe's one-layer stages do.
  auto run_plain = [&] {
    for (const at::Tensor& xm : x_plain.tensor_split(kMicro)) {
      std::vector<at::Tensor> inputs{xm};
      {
        torch::NoGradGuard no_grad;
        for (int64_t l = 0; l + 1 < kLayers; ++l) inputs.push_back(ref[l]->as<torch::nn::Linear>()->forward(inputs.back()));
      }
      at::Tensor g;
      for (int64_t l = kLayers - 1; l >= 0; --l) {
        at::Tensor in = inputs[l].detach().requires_grad_();
        at::Tensor out = ref[l]->as<torch::nn::Linear>()->forward(in);
        if (g.defined()) out.backward(g); else out.sum().backward();
        g = in.grad();
      }
    }
    if (on_gpu) torch::cuda::synchronize();
  };
  // Warm-up: the first calls fill the allocators' caches and the per-layer
  // timer; the benchmark measures the steady state a training loop runs in.
  for (int r = 0; r < kWarmup; ++r) {
    run_roundpipe();
    run_plain();
  }
  std::vector<double> t_rp, t_plain;
  for (int r = 0; r < kReps; ++r) {
    t_rp.push_back(bench::seconds(run_roundpipe));
    t_plain.push_back(bench::seconds(run_plain));
  }
  const double rp = bench::median(t_rp), plain = bench::median(t_plain);
  const double us_per_task = (rp - plain) / tasks * 1e6;
  std::printf("B2 dispatch overhead — %s\n", bench::machine_line().c_str());
  std::printf("devices %lld (%s), %lld layers, one-layer stages, M=%lld: %lld tasks per call\n",
              (long long)model.num_devices(), get_device_names().front().c_str(), (long long)kLayers,
              (long long)kMicro, (long long)tasks);
  std::printf("%-28s %10s\n", "", "median ms");
  std::printf("%-28s %10.3f\n", "roundpipe forward_backward", rp * 1e3);
  std::printf("%-28s %10.3f\n", "plain libtorch loop", plain * 1e3);
  std::printf("RESULT id=B2 us_per_task=%.2f roundpipe_ms=%.3f plain_ms=%.3f tasks=%lld devices=%lld\n",
              us_per_task, rp * 1e3, plain * 1e3, (long long)tasks, (long long)model.num_devices());
  return 0;
}
