// B3: end-to-end training steps of a small decoder-only transformer on one
// CPU device with asynchronous steps, against plain libtorch loops with the
// same microbatch split (a) with the same recomputation and (b) without.
// Timed in alternating blocks of steps that end with roundpipe's
// synchronize() (block_timing.h): a step returns before its backward stages
// are done, and timing one step of each side in turn charged that work to
// the loops. Parallelism: roundpipe's one device computes on its worker
// thread and the loops on the caller's, each with the same intra-op threads
// (printed); roundpipe's Adam runs on its optimizer thread (asynchronous
// steps, docs/guide.md), the loops' Adam inline.
#include <malloc.h>
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <thread>

#include "bench_common.h"

using namespace roundpipe;

namespace {

constexpr int64_t kDim = 256, kHeads = 4, kLayers = 8, kSeq = 128, kBatch = 16, kVocab = 512;

// The intra-op threads each side computes with, as seen where a block runs:
// the caller's thread (the loops) and roundpipe's device worker.
const std::thread::id g_caller = std::this_thread::get_id();
std::atomic<int> g_caller_threads{0}, g_worker_threads{0};
void note_threads() {
  (std::this_thread::get_id() == g_caller ? g_caller_threads : g_worker_threads) =
      at::get_num_threads();
}

struct BlockImpl : torch::nn::Cloneable<BlockImpl> {
  BlockImpl() { reset(); }
  void reset() override {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    qkv = register_module("qkv", torch::nn::Linear(kDim, 3 * kDim));
    proj = register_module("proj", torch::nn::Linear(kDim, kDim));
    fc = register_module("fc", torch::nn::Linear(kDim, 4 * kDim));
    out = register_module("out", torch::nn::Linear(4 * kDim, kDim));
  }
  at::Tensor forward(at::Tensor h) {
    note_threads();
    const int64_t b = h.size(0), t = h.size(1), hd = kDim / kHeads;
    auto parts = qkv(ln1(h)).view({b, t, 3, kHeads, hd}).permute({2, 0, 3, 1, 4});
    at::Tensor mask = torch::full({t, t}, -1e9, h.options()).triu(1);
    at::Tensor att = torch::softmax(parts[0].matmul(parts[1].transpose(-1, -2)) / std::sqrt(double(hd)) + mask, -1);
    h = h + proj(att.matmul(parts[2]).transpose(1, 2).reshape({b, t, kDim}));
    return h + out(torch::gelu(fc(ln2(h))));
  }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
};
TORCH_MODULE(Block);

struct HeadImpl : torch::nn::Cloneable<HeadImpl> {
  HeadImpl() { reset(); }
  void reset() override {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    proj = register_module("proj", torch::nn::Linear(kDim, kVocab));
  }
  at::Tensor forward(at::Tensor h) { return proj(ln(h)); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear proj{nullptr};
};
TORCH_MODULE(Head);

torch::nn::Sequential make_model() {
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Embedding(kVocab, kDim));
  for (int64_t i = 0; i < kLayers; ++i) seq->push_back(Block());
  seq->push_back(Head());
  return seq;
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1}));
}

// The plain loop with roundpipe's recomputation: forward stages without a
// graph keep the inputs of backward stages; the fused stage runs with grad;
// backward stages recompute from the kept input.
void step_with_recompute(torch::nn::Sequential& seq, const ModelExecutePlan& plan, const at::Tensor& x,
                         const at::Tensor& y, int64_t m) {
  auto layer = [&](int64_t l, at::Tensor h) {
    // Sequential's AnyModule call: Embedding, Block and Head all take a tensor.
    return seq->begin()[l].forward(std::move(h));
  };
  auto xs = x.tensor_split(m), ys = y.tensor_split(m);
  for (int64_t mb = 0; mb < m; ++mb) {
    std::map<int64_t, at::Tensor> kept;
    at::Tensor h = xs[mb];
    {
      torch::NoGradGuard no_grad;
      for (const auto& r : plan.fwd_plan) {
        for (int64_t l = r.begin; l < r.end; ++l) {
          kept[l] = h;
          h = layer(l, h);
        }
      }
    }
    const LayerRange fused = plan.bwd_plan.front();
    at::Tensor in = h.is_floating_point() ? h.detach().requires_grad_() : h;
    at::Tensor out = in;
    for (int64_t l = fused.begin; l < fused.end; ++l) out = layer(l, out);
    lm_loss(out, ys[mb]).backward();
    at::Tensor g = in.requires_grad() ? in.grad() : at::Tensor();
    for (size_t s = 1; s < plan.bwd_plan.size(); ++s) {
      const LayerRange r = plan.bwd_plan[s];
      at::Tensor sin = kept[r.begin];
      at::Tensor leaf = sin.is_floating_point() ? sin.detach().requires_grad_() : sin;
      at::Tensor o = leaf;
      for (int64_t l = r.begin; l < r.end; ++l) o = layer(l, o);
      o.backward(g);
      g = leaf.requires_grad() ? leaf.grad() : at::Tensor();
    }
  }
}

}  // namespace

int main() {
  // Same allocator settings for every side (page faults are slow here).
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, -1);
  torch::manual_seed(0);
  torch::nn::Sequential rp_net = make_model(), ckpt_net = make_model(), plain_net = make_model();
  RoundPipe model(rp_net, RoundPipeOptions().set_name("b3"));
  const int64_t m = model.num_devices() + 1;
  const ModelExecutePlan plan = model.default_execute_plan(RunKind::kFused);
  torch::optim::Adam rp_opt(model.optim_parameters(), torch::optim::AdamOptions(1e-4));
  torch::optim::Adam ckpt_opt(ckpt_net->parameters(), torch::optim::AdamOptions(1e-4));
  torch::optim::Adam plain_opt(plain_net->parameters(), torch::optim::AdamOptions(1e-4));
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return lm_loss(out.toTensor(), y.toTensor());
  };
  at::Tensor x = torch::randint(kVocab, {kBatch, kSeq}), y = torch::randint(kVocab, {kBatch, kSeq});

  auto rp_step = [&] {
    model.forward_backward({x}, make_kwargs(), y, loss_fn, false, RunConfig().execute_plan(plan));
    model.step([&] {
      rp_opt.step();
      rp_opt.zero_grad();
    });
  };
  auto ckpt_step = [&] {
    step_with_recompute(ckpt_net, plan, x, y, m);
    ckpt_opt.step();
    ckpt_opt.zero_grad();
  };
  auto plain_step = [&] {
    auto xs = x.tensor_split(m), ys = y.tensor_split(m);
    for (int64_t mb = 0; mb < m; ++mb) lm_loss(plain_net->forward(xs[mb]), ys[mb]).backward();
    plain_opt.step();
    plain_opt.zero_grad();
  };
  bench::BlockOptions opt;
  opt.warmup_rounds = 1;
  opt.rounds = 5;
  opt.steps_per_block = 2;
  const std::vector<bench::BlockTimes> t =
      bench::alternate_blocks({{"roundpipe", rp_step, [&] { model.synchronize(); }},
                               {"libtorch+ckpt", ckpt_step, nullptr},
                               {"libtorch", plain_step, nullptr}},
                              opt);
  const double rp = t[0].median, ckpt = t[1].median, plain = t[2].median;
  std::printf("B3 end-to-end CPU training step — %s\n", bench::machine_line().c_str());
  std::printf("decoder d=%lld, %lld layers, seq %lld, batch %lld, fp32, %lld microbatches, devices %lld\n",
              (long long)kDim, (long long)kLayers, (long long)kSeq, (long long)kBatch, (long long)m,
              (long long)model.num_devices());
  std::printf("plan: %s\n", plan.to_string().c_str());
  std::printf("allocator: M_MMAP_THRESHOLD=1GiB, M_TRIM_THRESHOLD=-1 for all sides\n");
  std::printf("%s\n", bench::describe(opt).c_str());
  std::printf("pairing: roundpipe on %lld CPU device(s), its worker computing with %d intra-op "
              "threads, against the loops on the caller's thread with %d; roundpipe's Adam on its "
              "optimizer thread, the loops' inline\n",
              (long long)model.num_devices(), g_worker_threads.load(), g_caller_threads.load());
  std::printf("%-40s %10s %10s %10s\n", "", "median ms", "min ms", "max ms");
  const char* rows[] = {"roundpipe (async step, torch Adam)", "libtorch, same recomputation",
                        "libtorch, no recomputation"};
  for (size_t i = 0; i < t.size(); ++i) {
    std::printf("%-40s %10.1f %10.1f %10.1f\n", rows[i], t[i].median * 1e3, t[i].min * 1e3,
                t[i].max * 1e3);
  }
  std::printf("target (docs/guide.md): step_time_vs_libtorch_ckpt <= 1.05: %.3f, %s\n", rp / ckpt,
              rp / ckpt <= 1.05 ? "met" : "NOT met");
  std::printf("RESULT id=B3 step_time_vs_libtorch_ckpt=%.3f step_time_vs_libtorch=%.3f "
              "roundpipe_ms=%.1f libtorch_ckpt_ms=%.1f libtorch_ms=%.1f devices=%lld "
              "threads_worker=%d threads_caller=%d\n",
              rp / ckpt, rp / plain, rp * 1e3, ckpt * 1e3, plain * 1e3,
              (long long)model.num_devices(), g_worker_threads.load(), g_caller_threads.load());
  return 0;
}
