// Buffers handed from call to call (docs/design/engine.md, "Iteration
// overlap"): a buffer no layer writes is never downloaded, so no call waits
// for its write-back; a buffer is downloaded and ordered exactly from the
// first call that writes it on, also when that write goes through `.data()`
// (which version counters do not see). Results are bitwise those without
// overlap.
#include <gtest/gtest.h>
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "copy_delay.h"
#include "engine/trace_recorder.h"
#include "models.h"

namespace roundpipe {
namespace {

constexpr int kCalls = 6;
constexpr int kFirstWrite = 3;  // the call from which layer 0 writes `calls`
constexpr int64_t kMicrobatches = 3;

// Layer 0: a rotary-like table it only reads, and a counter of the
// microbatches it has seen since its inputs grew large (the caller's inputs
// of call kFirstWrite on), written through .data() and read back into the
// output, so a stale value would change every later result.
struct WatchedImpl : torch::nn::Cloneable<WatchedImpl> {
  WatchedImpl() { reset(); }
  void reset() override {
    inv_freq = register_buffer("inv_freq", torch::pow(100.0, -torch::arange(8, torch::kFloat) / 8));
    calls = register_buffer("calls", torch::zeros({}));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (x.abs().max().item<float>() > 50) calls.data().add_(1);
    return torch::tanh(x * 0.01) * (1 + 0.01 * calls) + 0.1 * inv_freq.repeat({2});
  }
  at::Tensor inv_freq, calls;
};
TORCH_MODULE(Watched);

torch::nn::Sequential watched_mlp() {
  torch::nn::Sequential seq;
  seq->push_back(Watched());
  torch::nn::Sequential mlp = testing::make_mlp();
  for (const auto& layer : *mlp) seq->push_back(layer);
  return seq;
}

ModelExecutePlan plan() {
  ModelExecutePlan p;
  p.fwd_plan = {{0, 3}, {3, 6}};
  p.bwd_plan = {{6, 10}, {3, 6}, {0, 3}};
  return p;
}

struct Trained {
  std::vector<double> losses;
  std::vector<std::pair<std::string, at::Tensor>> state;
  std::map<int64_t, int64_t> buffer_bytes;  // [call]: bytes of buffers downloaded
};

Trained train(bool overlap) {
  torch::manual_seed(3);
  RoundPipe model(
      watched_mlp(),
      RoundPipeOptions().set_max_devices(3).set_seed(5).set_name("watched").set_overlap_iterations(
          overlap));
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const RunConfig cfg = RunConfig().num_microbatch(kMicrobatches).execute_plan(plan());
  const std::string path = ::testing::TempDir() + "/buffer_writes_trace.json";
  start_trace(path);
  Trained out;
  for (int i = 0; i < kCalls; ++i) {
    torch::manual_seed(100 + i);
    at::Tensor x = torch::randn({6, 16}) * (i >= kFirstWrite ? 100.0 : 1.0),
               y = torch::randn({6, 4});
    c10::IValue loss =
        model.forward_backward({x}, make_kwargs(), y, testing::mse_loss_fn(), false, cfg);
    out.losses.push_back(loss.toTensor().item<double>());
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
  }
  model.synchronize();
  std::vector<TraceEvent> events = Tracer::instance().events();
  stop_trace();
  std::remove(path.c_str());
  for (const TraceEvent& e : events) {
    if (e.model == "watched" && e.kind == "download" && e.name.rfind("buffers", 0) == 0) {
      out.buffer_bytes[e.call] += e.bytes;
    }
  }
  for (const auto& [name, t] : model.state_dict()) out.state.emplace_back(name, t.detach().clone());
  return out;
}

TEST(BufferWrites, AReadOnlyBufferIsNeverDownloadedAndAWrittenOneFromItsFirstWriteOn) {
  testing::CopyDelay delay(300);  // a read before its fence reads NaN
  const Trained plain = train(/*overlap=*/false);
  const Trained overlapped = train(/*overlap=*/true);
  for (const Trained* run : {&plain, &overlapped}) {
    SCOPED_TRACE(run == &plain ? "without overlap" : "with overlap");
    // Calls before the first write download nothing; from it on, the
    // counter's 4 bytes and never the table's 32.
    std::map<int64_t, int64_t> expected;
    for (int64_t call = kFirstWrite; call < kCalls; ++call) expected[call] = 4;
    EXPECT_EQ(run->buffer_bytes, expected);
  }
  EXPECT_EQ(overlapped.losses, plain.losses);
  ASSERT_EQ(overlapped.state.size(), plain.state.size());
  for (size_t i = 0; i < plain.state.size(); ++i) {
    EXPECT_EQ(overlapped.state[i].first, plain.state[i].first);
    EXPECT_TRUE(torch::equal(overlapped.state[i].second, plain.state[i].second))
        << plain.state[i].first;
  }
  // Every microbatch from the first write on counted, each call seeing the
  // count the one before left.
  const at::Tensor table = torch::pow(100.0, -torch::arange(8, torch::kFloat) / 8);
  for (const Trained* run : {&plain, &overlapped}) {
    for (const auto& [name, t] : run->state) {
      if (name == "0.calls") {
        EXPECT_EQ(t.item<float>(), (kCalls - kFirstWrite) * kMicrobatches);
      } else if (name == "0.inv_freq") {
        EXPECT_TRUE(torch::equal(t, table));
      }
    }
  }
}

}  // namespace
}  // namespace roundpipe
