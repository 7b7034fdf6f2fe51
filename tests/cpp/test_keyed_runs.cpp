// Keyed layer runs on CPU devices (engine/rng.h): each device's worker draws
// from a generator of its own, so keyed layers of different devices run at
// the same time, as on GPUs, and the process's generator is left alone.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <torch/optim/sgd.h>

#include "engine/engine_access.h"
#include "engine/layer_handle.h"
#include "models.h"

namespace roundpipe {
namespace testing {
namespace {

// A linear layer that may draw (so every run is keyed) and, before its
// forward, waits up to `kRendezvous` for a run of another layer to be inside
// at the same time, until that has happened once (`most` records how many
// runs ever were inside together). The first run of layer 0 does not wait:
// nothing else can run then.
class RendezvousLayer final : public LayerHandle {
 public:
  static constexpr auto kRendezvous = std::chrono::seconds(5);

  RendezvousLayer(int64_t index, std::atomic<int>& inside, std::atomic<int>& most)
      : inner_(make_module_layer(torch::nn::AnyModule(torch::nn::Linear(4, 4)), index)),
        skip_first_(index == 0),
        inside_(inside),
        most_(most) {}
  std::string type_name() const override { return "RendezvousLayer"; }
  NamedTensors named_parameters() const override { return inner_->named_parameters(); }
  NamedTensors named_buffers() const override { return inner_->named_buffers(); }
  bool is_training() const override { return inner_->is_training(); }
  void train(bool on) override { inner_->train(on); }
  void make_replicas(int count) override { inner_->make_replicas(count); }
  std::vector<at::Tensor> bind(int replica, const std::vector<at::Tensor>& params,
                               const std::vector<at::Tensor>& buffers) override {
    return inner_->bind(replica, params, buffers);
  }
  std::vector<at::Tensor> bound_buffers(int replica) override {
    return inner_->bound_buffers(replica);
  }
  void unbind(int replica) override { inner_->unbind(replica); }
  c10::IValue forward(int replica, std::vector<c10::IValue> args, Kwargs kwargs) override {
    int seen = ++inside_;
    const bool waits = !(skip_first_ && runs_++ == 0);
    const auto until = std::chrono::steady_clock::now() + kRendezvous;
    while (waits && seen < 2 && most_.load() < 2 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      seen = inside_.load();
    }
    int m = most_.load();
    while (seen > m && !most_.compare_exchange_weak(m, seen)) {
    }
    c10::IValue out = inner_->forward(replica, std::move(args), std::move(kwargs));
    --inside_;
    return out;
  }

 private:
  std::shared_ptr<LayerHandle> inner_;
  const bool skip_first_;
  std::atomic<int> runs_{0};
  std::atomic<int>& inside_;
  std::atomic<int>& most_;
};

TEST(KeyedRuns, CpuDevicesRunKeyedLayersAtTheSameTime) {
  std::atomic<int> inside{0}, most{0};
  std::vector<std::shared_ptr<LayerHandle>> layers{
      std::make_shared<RendezvousLayer>(0, inside, most),
      std::make_shared<RendezvousLayer>(1, inside, most)};
  ASSERT_TRUE(layers[0]->may_draw_random());
  RoundPipe model =
      detail::EngineAccess::from_layers(layers, RoundPipeOptions().set_max_devices(2).set_seed(3));
  // Two stages on two devices: stage 1 of microbatch m runs while stage 0
  // runs microbatch m + 1, unless keyed runs exclude each other.
  const RunConfig cfg =
      RunConfig().num_microbatch(3).execute_plan(ModelExecutePlan{{{0, 1}, {1, 2}}, {}});
  at::NoGradGuard no_grad;
  model.forward({torch::randn({6, 4})}, make_kwargs(), cfg);
  EXPECT_EQ(most.load(), 2) << "keyed runs of two CPU devices never ran at the same time";
}

TEST(KeyedRuns, LeaveTheProcessGeneratorAlone) {
  torch::manual_seed(0);
  RoundPipe model(make_transformer(/*dropout=*/0.5),
                  RoundPipeOptions().set_max_devices(2).set_seed(3));
  torch::manual_seed(5);
  const at::Tensor expected = at::rand({8});
  torch::manual_seed(5);
  const at::Tensor ids = at::zeros({4, kSeq}, at::kLong);
  model.forward_backward({ids}, make_kwargs(), ids,
                         [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
                           return lm_loss(out.toTensor(), y.toTensor());
                         });
  model.synchronize();
  EXPECT_TRUE(at::equal(at::rand({8}), expected))
      << "a keyed run drew from the process's generator";
}

// Layer 0 of RecomputeHeld: a keyed random mask, then a Linear. Its first
// run with grad enabled after `armed` (its recomputation in a backward
// stage) signals `inside` and waits for `release`.
std::atomic<bool> armed{false}, inside_recompute{false}, release{false};

struct HeldMaskImpl : torch::nn::Cloneable<HeldMaskImpl> {
  HeldMaskImpl() { reset(); }
  void reset() override { lin = register_module("lin", torch::nn::Linear(16, 16)); }
  at::Tensor forward(at::Tensor x) {
    if (torch::GradMode::is_enabled() && armed.exchange(false)) {
      inside_recompute = true;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!release.load() && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    return lin(x * (torch::rand_like(x) > 0.5).to(x.scalar_type()) * 2);
  }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(HeldMask);

struct HeldRun {
  std::vector<at::Tensor> params;
  at::Tensor first_draw, next_draw;  // the caller's, after its manual_seed(5)
};

// Two SGD steps, layer 0 in a backward stage of its own (so it is
// recomputed); with `draw`, the caller seeds and draws while the first
// call's recomputation of layer 0 runs.
HeldRun train_held(bool overlap, bool draw) {
  torch::manual_seed(7);
  torch::nn::Sequential seq(HeldMask(), torch::nn::Linear(16, 16), torch::nn::Tanh(),
                            torch::nn::Linear(16, 4));
  RoundPipe model(
      seq, RoundPipeOptions().set_max_devices(2).set_seed(11).set_overlap_iterations(overlap));
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.05));
  const RunConfig cfg = RunConfig().num_microbatch(2).execute_plan(
      ModelExecutePlan{{{0, 1}, {1, 2}}, {{2, 4}, {1, 2}, {0, 1}}});
  HeldRun out;
  for (int i = 0; i < 2; ++i) {
    torch::manual_seed(100 + i);
    const at::Tensor x = torch::randn({4, 16}), y = torch::randn({4, 4});
    const bool now = draw && i == 0;
    if (now) {
      inside_recompute = false;
      release = false;
      armed = true;
    }
    model.forward_backward({x}, make_kwargs(), y, mse_loss_fn(), false, cfg);
    if (now) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!inside_recompute.load() && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      EXPECT_TRUE(inside_recompute.load())
          << "layer 0 was never recomputed after the call returned";
      torch::manual_seed(5);
      out.first_draw = torch::rand({4});
      release = true;
    }
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
    if (i == 0) {
      model.synchronize();  // in both runs: the second call then sees θ_1
      if (now) out.next_draw = torch::rand({4});
    }
  }
  model.synchronize();
  for (const at::Tensor& p : model.parameters()) out.params.push_back(p.detach().clone());
  return out;
}

// The caller may use the process's generator while a call in flight runs
// keyed layers: neither changes the other's draws.
TEST(KeyedRuns, TheCallerDrawsWhileACallInFlightRecomputesAKeyedLayer) {
  torch::manual_seed(5);
  const at::Tensor first = torch::rand({4}), next = torch::rand({4});
  const HeldRun plain = train_held(/*overlap=*/false, /*draw=*/false);
  const HeldRun raced = train_held(/*overlap=*/true, /*draw=*/true);
  EXPECT_TRUE(raced.first_draw.equal(first)) << "the caller's draw after its manual_seed";
  EXPECT_TRUE(raced.next_draw.equal(next)) << "the caller's stream after the call in flight ended";
  ASSERT_EQ(raced.params.size(), plain.params.size());
  for (size_t i = 0; i < plain.params.size(); ++i) {
    EXPECT_TRUE(raced.params[i].equal(plain.params[i])) << "parameter " << i;
  }
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
