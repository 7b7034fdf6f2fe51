// The accelerator path. Runs when the pool is CUDA devices
// (ROUNDPIPE_DEVICES=cuda, see scripts/gpu-check); skipped otherwise.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <future>

#include "engine/host_store.h"
#include "runtime/cuda_memory.h"
#include "runtime/device_pool.h"
#include "models.h"

namespace roundpipe {
namespace testing {
namespace {

bool pool_is_cuda() { return get_device_names().front().rfind("cuda", 0) == 0; }

#define SKIP_WITHOUT_CUDA() \
  if (!pool_is_cuda()) GTEST_SKIP() << "needs ROUNDPIPE_DEVICES=cuda (pool is " << get_device_names().front() << ")"

TEST(Gpu, ForwardBackwardMatchesPlainLibtorchOnTheGpu) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(31);
  torch::nn::Sequential net = make_mlp(64, 6, 8);
  torch::nn::Sequential ref = copy_of(net);
  ref->to(torch::kCUDA);
  RoundPipe model(net);
  LossFn loss_fn = [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    EXPECT_TRUE(out.toTensor().is_cuda());  // loss_fn runs next to the outputs
    return torch::mse_loss(out.toTensor(), y.toTensor());
  };
  at::Tensor x = torch::randn({12, 64}), y = torch::randn({12, 8});
  for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
    for (auto& p : net->parameters()) p.mutable_grad().reset();
    for (auto& p : ref->parameters()) p.mutable_grad().reset();
    double loss = model.forward_backward({x}, make_kwargs(), y, loss_fn, false,
                                         RunConfig().num_microbatch(3).recompute_grain(grain))
                      .toTensor().item<double>();
    model.synchronize();
    double ref_loss = 0;
    auto xs = x.cuda().tensor_split(3), ys = y.cuda().tensor_split(3);
    for (int m = 0; m < 3; ++m) {
      at::Tensor l = torch::mse_loss(ref->forward(xs[m]), ys[m]);
      l.backward();
      ref_loss += l.item<double>();
    }
    EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss));
    std::vector<at::Tensor> ref_grads;
    for (auto& g : grads_of(ref->parameters())) ref_grads.push_back(g.cpu());
    expect_all_close(grads_of(net->parameters()), ref_grads, 1e-5, "gradients on the GPU");
  }
}

// scripts/gpu-check runs this one first in a process of its own: the
// caching allocator refuses statistics before CUDA's first allocation.
TEST(Gpu, MemoryStatsBeforeAnyAllocation) {
  SKIP_WITHOUT_CUDA();
  const std::vector<DeviceMemoryStats> stats = device_memory_stats();
  ASSERT_EQ(stats.size(), static_cast<size_t>(get_num_devices()));
  for (const DeviceMemoryStats& s : stats) {
    EXPECT_GE(s.allocated_bytes, 0);
    EXPECT_GE(s.max_reserved_bytes, s.max_allocated_bytes);
  }
}

TEST(Gpu, ParameterArenasArePageLocked) {
  SKIP_WITHOUT_CUDA();
  torch::nn::Sequential net = make_mlp();
  RoundPipe model(net);
  for (const auto& p : net->parameters()) EXPECT_TRUE(p.is_pinned());
}

TEST(Gpu, TheSlabPageLocksExactlyTheParametersAndIsReleasedWithTheModel) {
  SKIP_WITHOUT_CUDA();
  const int64_t before = cuda::page_locked_host_bytes();
  int64_t param_bytes = 0;
  {
    torch::nn::Sequential net = make_mlp(256, 6, 8);
    for (const auto& p : net->parameters()) param_bytes += p.numel() * p.element_size();
    RoundPipe model(net);
    const int64_t locked = cuda::page_locked_host_bytes() - before;
    EXPECT_GE(locked, param_bytes);
    EXPECT_LE(locked, param_bytes + 64 * static_cast<int64_t>(net->parameters().size()))
        << "one slab of the exact size (64-byte alignment), no power-of-two rounding";
  }
  EXPECT_EQ(cuda::page_locked_host_bytes(), before);
}

TEST(Gpu, RegisterPageLocksTheModelsOwnMemoryInPlaceUntilTheModelGoes) {
  SKIP_WITHOUT_CUDA();
  torch::nn::Sequential net = make_mlp();
  std::vector<const void*> ptrs;
  for (const auto& p : net->parameters()) {
    EXPECT_FALSE(p.is_pinned());
    ptrs.push_back(p.data_ptr());
  }
  {
    RoundPipe model(net, RoundPipeOptions().set_pin_model(PinMode::kRegister));
    const auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i].data_ptr(), ptrs[i]) << "in place";
      EXPECT_TRUE(params[i].is_pinned()) << i;
    }
  }
  for (const auto& p : net->parameters()) EXPECT_FALSE(p.is_pinned()) << "unregistered with the model";
}

// Allocates far more than any device has.
TEST(Gpu, ADownloadGathersSmallTensorsAndEveryTensorKeepsItsValue) {
  SKIP_WITHOUT_CUDA();
  Device& dev = DevicePool::instance().device(0);
  std::vector<at::Tensor> on_gpu;
  for (int i = 0; i < 40; ++i) on_gpu.push_back(torch::randn({i % 7 + 1, 3}, torch::kCUDA));
  on_gpu.push_back(torch::randn({1 << 19}, torch::kCUDA));        // 2 MiB: copied alone
  on_gpu.push_back(torch::randn({8, 6}, torch::kCUDA).t());       // not contiguous
  on_gpu.push_back(torch::randn({5}, torch::kCUDA).to(torch::kBFloat16));
  on_gpu.push_back(torch::arange(9, torch::TensorOptions(torch::kCUDA).dtype(torch::kLong)));
  on_gpu.push_back(torch::randn({4}));  // a layer's output left on the host: not gathered with the GPU's
  on_gpu.push_back(at::Tensor());
  torch::cuda::synchronize();
  std::vector<at::Tensor> host;
  std::promise<void> done;
  dev.submit([&] {
    host = dev.download(on_gpu);
    dev.lane_fence(Lane::kDownload)->synchronize();
    done.set_value();
  });
  done.get_future().wait();
  ASSERT_EQ(host.size(), on_gpu.size());
  EXPECT_FALSE(host.back().defined());
  for (size_t i = 0; i + 1 < host.size(); ++i) {
    EXPECT_TRUE(host[i].is_pinned()) << i;
    EXPECT_TRUE(host[i].equal(on_gpu[i].cpu())) << i;
  }
}

TEST(Gpu, InputGradientsComeBackOnTheInputsDevice) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(5);
  torch::nn::Sequential net = make_mlp(32, 4, 8);
  torch::nn::Sequential ref = copy_of(net);
  ref->to(torch::kCUDA);
  RoundPipe model(net);
  at::Tensor x = torch::randn({6, 32}, torch::kCUDA).requires_grad_();
  at::Tensor y = torch::randn({6, 8}, torch::kCUDA);
  model.forward_backward({x}, make_kwargs(), y, mse_loss_fn(), false, RunConfig().num_microbatch(2));
  model.synchronize();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(x.grad().is_cuda()) << "autograd rejects a gradient on another device than its input";
  at::Tensor rx = x.detach().clone().requires_grad_();
  auto xs = rx.tensor_split(2), ys = y.tensor_split(2);
  for (int m = 0; m < 2; ++m) torch::mse_loss(ref->forward(xs[m]), ys[m]).backward();
  EXPECT_TRUE(torch::allclose(x.grad(), rx.grad(), 1e-5, 1e-6));
}

// Page-locked host memory a loop uses is made in its first iterations and
// reused after: the blocks of downloads by size, host hand-offs let go
// when their job took them.
TEST(Gpu, PageLockedHostMemoryStaysFlatOverIterations) {
  SKIP_WITHOUT_CUDA();
  torch::nn::Sequential net = make_mlp(256, 6, 8);
  RoundPipe model(net);
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.01));
  auto iteration = [&] {
    model.forward_backward({torch::randn({32, 256})}, make_kwargs(), torch::randn({32, 8}), mse_loss_fn(), false,
                           RunConfig().num_microbatch(4));
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
  };
  for (int i = 0; i < 3; ++i) iteration();
  model.synchronize();
  const int64_t warm = cuda::page_locked_host_bytes();
  for (int i = 0; i < 8; ++i) iteration();
  model.synchronize();
  // How many blocks are in flight at a moment varies a little with timing;
  // what must not happen is growth with the iterations.
  EXPECT_LE(cuda::page_locked_host_bytes(), warm + warm / 10 + (int64_t{1} << 20))
      << "page-locked host memory grew after the loop warmed up (" << warm << " bytes then)";
}

// The caching allocator keeps each stream's blocks apart: what the upload
// streams hold is bounded by the stage slots, so reserved memory stays near
// what is allocated at the peak.
TEST(Gpu, ReservedDeviceMemoryStaysNearAllocated) {
  SKIP_WITHOUT_CUDA();
  torch::nn::Sequential net = make_mlp(1024, 8, 8);
  RoundPipe model(net, RoundPipeOptions().set_max_devices(1));
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.01));
  reset_peak_device_memory();  // this test's peaks, not earlier tests'
  for (int i = 0; i < 4; ++i) {
    model.forward_backward({torch::randn({64, 1024})}, make_kwargs(), torch::randn({64, 8}), mse_loss_fn(), false,
                           RunConfig().num_microbatch(4));
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
  }
  model.synchronize();
  const int index = DevicePool::instance().device(0).torch_device().index();
  const int64_t allocated = cuda::peak_allocated_bytes(index), reserved = cuda::peak_reserved_bytes(index);
  std::printf("RESULT id=gpu-reserved peak_allocated_mib=%.1f peak_reserved_mib=%.1f\n", allocated / 1048576.0,
              reserved / 1048576.0);
  EXPECT_LE(reserved, 2 * allocated + (int64_t{64} << 20));
}

TEST(Gpu, ADownloadOfATensorOnAnotherGpuIsCompleteAtTheDownloadFence) {
  SKIP_WITHOUT_CUDA();
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  Device& dev = DevicePool::instance().device(0);
  const c10::Device other(c10::kCUDA, dev.torch_device().index() == 0 ? 1 : 0);
  at::Tensor big = torch::full({int64_t(1) << 24}, 3.0, torch::TensorOptions().device(other));
  std::vector<at::Tensor> host;
  std::promise<void> done;
  dev.submit([&] {
    host = dev.download({big});
    dev.lane_fence(Lane::kDownload)->synchronize();
    done.set_value();
  });
  done.get_future().wait();
  EXPECT_TRUE(host[0].equal(big.cpu()));
}

// Layer buffers and the caller's inputs live in pageable memory: they are
// staged in page-locked memory before their asynchronous upload (a copy
// from pageable memory would make the driver wait for the stream's earlier
// work), and arrive intact.
TEST(Gpu, BuffersAndInputsInPageableMemoryArriveIntact) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(9);
  torch::nn::Sequential net(torch::nn::Linear(16, 16), torch::nn::BatchNorm1d(16), torch::nn::Linear(16, 4));
  torch::nn::Sequential ref = copy_of(net);
  ref->to(torch::kCUDA);
  RoundPipe model(net);
  at::Tensor x = torch::randn({8, 16}), y = torch::randn({8, 4});
  ASSERT_FALSE(x.is_pinned());
  model.forward_backward({x}, make_kwargs(), y, mse_loss_fn(), false, RunConfig().num_microbatch(2));
  model.synchronize();
  auto xs = x.cuda().tensor_split(2), ys = y.cuda().tensor_split(2);
  for (int m = 0; m < 2; ++m) torch::mse_loss(ref->forward(xs[m]), ys[m]).backward();
  std::vector<at::Tensor> ref_grads;
  for (auto& g : grads_of(ref->parameters())) ref_grads.push_back(g.cpu());
  expect_all_close(grads_of(net->parameters()), ref_grads, 1e-5, "gradients");
  const auto buffers = net->buffers(), ref_buffers = ref->buffers();
  for (size_t i = 0; i < buffers.size(); ++i) {
    EXPECT_TRUE(torch::allclose(buffers[i].to(torch::kDouble), ref_buffers[i].cpu().to(torch::kDouble), 1e-5, 1e-6))
        << "buffer " << i;
  }
}

struct HogImpl : torch::nn::Cloneable<HogImpl> {
  void reset() override {}
  at::Tensor forward(at::Tensor x) { return x + torch::empty({int64_t(1) << 50}, x.options()).sum(); }
};
TORCH_MODULE(Hog);

TEST(Gpu, OutOfMemoryIsAClearErrorAndTheModelStaysUsable) {
  SKIP_WITHOUT_CUDA();
  torch::nn::Sequential bad(torch::nn::Linear(8, 8), Hog());
  RoundPipe hog(bad, RoundPipeOptions().set_name("hog"));
  try {
    hog.forward(torch::randn({4, 8}));
    FAIL() << "expected out of memory";
  } catch (const c10::Error& e) {
    EXPECT_THAT(std::string(e.what()), ::testing::HasSubstr("RoundPipe model 'hog'"));
  }
  torch::nn::Sequential net = make_mlp();
  RoundPipe model(net);
  EXPECT_EQ(model.forward(torch::randn({4, 16})).size(0), 4);
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
