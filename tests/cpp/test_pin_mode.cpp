// PinMode: where the host parameters live. kAlloc copies them into the
// engine's arenas; kRegister and kOff leave them where they are. All train
// alike, bit for bit.
#include <gtest/gtest.h>
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "models.h"

namespace roundpipe {
namespace {

std::vector<const void*> data_ptrs(const torch::nn::Sequential& net) {
  std::vector<const void*> out;
  for (const at::Tensor& p : net->parameters()) out.push_back(p.data_ptr());
  return out;
}

// Three asynchronous SGD steps; the losses.
std::vector<float> train(RoundPipe& model) {
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const RunConfig cfg = RunConfig().num_microbatch(3);
  std::vector<float> losses;
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(10 + step);
    at::Tensor x = torch::randn({6, 16}), y = torch::randn({6, 4});
    c10::IValue loss = model.forward_backward({x}, make_kwargs(), y, testing::mse_loss_fn(), false, cfg);
    losses.push_back(loss.toTensor().item<float>());
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
  }
  model.synchronize();
  return losses;
}

TEST(PinMode, NamesRoundTripAndABadNameSaysWhatIsAccepted) {
  for (PinMode mode : {PinMode::kAlloc, PinMode::kRegister, PinMode::kOff}) {
    EXPECT_EQ(pin_mode_from_name(pin_mode_name(mode)), mode);
  }
  try {
    pin_mode_from_name("yes");
    FAIL() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'alloc', 'register' or 'off', got 'yes'"), std::string::npos) << e.what();
  }
}

TEST(PinMode, RegisterAndOffLeaveParametersInPlaceAndTrainLikeAlloc) {
  torch::manual_seed(3);
  torch::nn::Sequential reference_net = testing::make_mlp();
  const std::vector<const void*> reference_before = data_ptrs(reference_net);
  RoundPipe reference(reference_net, RoundPipeOptions().set_max_devices(2));
  EXPECT_NE(data_ptrs(reference_net), reference_before) << "kAlloc packs the parameters into arenas";
  const std::vector<float> want = train(reference);
  for (PinMode mode : {PinMode::kRegister, PinMode::kOff}) {
    torch::manual_seed(3);
    torch::nn::Sequential net = testing::make_mlp();
    const std::vector<const void*> before = data_ptrs(net);
    RoundPipe model(net, RoundPipeOptions().set_max_devices(2).set_pin_model(mode));
    EXPECT_EQ(data_ptrs(net), before) << pin_mode_name(mode);
    EXPECT_EQ(train(model), want) << pin_mode_name(mode);
    EXPECT_EQ(data_ptrs(net), before) << pin_mode_name(mode) << ": the step writes the model's own tensors";
    const auto a = net->parameters(), b = reference_net->parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << pin_mode_name(mode) << " " << i;
  }
}

TEST(PinMode, AllocPacksEveryLayerIntoOneSlabInLayerOrder) {
  // A stage is then one range of the slab, uploaded in one copy.
  torch::manual_seed(3);
  torch::nn::Sequential net = testing::make_mlp();
  RoundPipe model(net, RoundPipeOptions().set_max_devices(2));
  const auto params = net->parameters();
  ASSERT_GE(params.size(), 4u);
  const auto* first = static_cast<const uint8_t*>(params.front().data_ptr());
  int64_t bytes = 0;
  const uint8_t* end = first;
  for (const at::Tensor& p : params) {
    const auto* at = static_cast<const uint8_t*>(p.data_ptr());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(at) % 64, 0u) << "aligned";
    EXPECT_GE(at, end) << "in layer order, not overlapping";
    end = at + p.nbytes();
    bytes += (static_cast<int64_t>(p.nbytes()) + 63) / 64 * 64;
  }
  // One allocation: no gaps beyond each parameter's rounding to 64 bytes
  // (separate allocations would leave their headers between layers).
  EXPECT_LE(end - first, bytes);
}

}  // namespace
}  // namespace roundpipe
