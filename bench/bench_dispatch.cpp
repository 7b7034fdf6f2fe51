// B2: per (stage, microbatch) task overhead. 64 tiny layers in one-layer
// stages, 3 microbatches, forward_backward; against a plain libtorch loop
// doing the same microbatches with the same recomputation, with the same
// parallelism: one device (scripts/bench B2 runs cpu:1) against the loop on
// one thread. On more devices the calls' stages run in parallel and the
// difference is no per-task cost; the output says so.
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

#include <cstdio>

#include "bench_common.h"

using namespace roundpipe;

int main() {
  constexpr int64_t kLayers = 64, kWidth = 8, kBatch = 6, kMicro = 3;
  constexpr int kRounds = 9, kCallsPerBlock = 5;
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

  // Returns at its losses (iterations overlap): the block's synchronize()
  // counts the rest of the call's work (block_timing.h).
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
  };
  // The warm-up round (one block per side) fills the allocators' caches and
  // the per-layer timer: the benchmark measures the steady state a training
  // loop runs in.
  bench::BlockOptions opt;
  opt.warmup_rounds = 1;
  opt.rounds = kRounds;
  opt.steps_per_block = kCallsPerBlock;
  const std::vector<bench::BlockTimes> t = bench::alternate_blocks(
      {{"roundpipe", run_roundpipe, [&] { model.synchronize(); }},
       {"plain", run_plain, [&] { if (on_gpu) torch::cuda::synchronize(); }}},
      opt);
  const double rp = t[0].median, plain = t[1].median;
  const double us_per_task = (rp - plain) / tasks * 1e6;
  const int64_t devices = model.num_devices();
  const bool same_parallelism = devices == 1;
  const double target_us = on_gpu ? 30 : 20;
  std::printf("B2 dispatch overhead — %s\n", bench::machine_line().c_str());
  std::printf("devices %lld (%s), %lld layers, one-layer stages, M=%lld: %lld tasks per call\n",
              (long long)devices, get_device_names().front().c_str(), (long long)kLayers,
              (long long)kMicro, (long long)tasks);
  std::printf("%s\n", bench::describe(opt).c_str());
  if (same_parallelism) {
    std::printf("pairing: one %s device against the plain loop on one thread "
                "(the same parallelism)\n",
                on_gpu ? "GPU" : "CPU");
  } else {
    std::printf("pairing: %lld devices against the plain loop on one thread: NOT the same "
                "parallelism; the calls' stages run in parallel, so us_per_task understates the "
                "cost per task (run with ROUNDPIPE_DEVICES=%s:1)\n",
                (long long)devices, on_gpu ? "cuda" : "cpu");
  }
  std::printf("%-28s %10s %10s %10s\n", "", "median ms", "min ms", "max ms");
  const char* rows[] = {"roundpipe forward_backward", "plain libtorch loop"};
  for (size_t i = 0; i < t.size(); ++i) {
    std::printf("%-28s %10.3f %10.3f %10.3f\n", rows[i], t[i].median * 1e3, t[i].min * 1e3,
                t[i].max * 1e3);
  }
  std::printf("target (docs/guide.md): < %.0f us per task on %s devices: %.2f us, %s\n", target_us,
              on_gpu ? "GPU" : "CPU", us_per_task,
              !same_parallelism ? "not judged (not the same parallelism)"
                                : (us_per_task < target_us ? "met" : "NOT met"));
  std::printf("RESULT id=B2 us_per_task=%.2f roundpipe_ms=%.3f plain_ms=%.3f tasks=%lld "
              "devices=%lld same_parallelism=%d target_us=%.0f\n",
              us_per_task, rp * 1e3, plain * 1e3, (long long)tasks, (long long)devices,
              same_parallelism ? 1 : 0, target_us);
  return 0;
}
