// Page-locked host memory that does not grow past what a loop needs:
// blocks reused by size, host hand-offs let go when taken, fp32 gradients
// that do not keep a download run's buffer (docs/design/engine.md, memory).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "engine/call.h"
#include "engine/gradient_sums.h"
#include "runtime/download_batch.h"
#include "runtime/host_block_pool.h"
#include "runtime/tensor_over.h"

namespace roundpipe {
namespace {

// A pool over ordinary memory that counts what it made.
struct CountingPool {
  int64_t made = 0;
  HostBlockPool pool{[this](int64_t bytes) {
    ++made;
    return at::empty({bytes}, at::kByte);
  }};
};

TEST(HostBlockPool, ABlockGivenBackServesTheSameSizeAgain) {
  CountingPool p;
  void* first = nullptr;
  {
    at::Tensor a = p.pool.take(10000);
    EXPECT_EQ(a.numel(), 10000);
    EXPECT_EQ(p.pool.in_use_bytes(), 12288) << "whole pages";
    first = a.data_ptr();
    a.fill_(7);
  }
  EXPECT_EQ(p.pool.in_use_bytes(), 0);
  EXPECT_EQ(p.pool.cached_bytes(), 12288);
  for (int i = 0; i < 5; ++i) {
    at::Tensor again = p.pool.take(10000);
    EXPECT_EQ(again.data_ptr(), first);
  }
  EXPECT_EQ(p.made, 1) << "a loop of one size makes one block";
}

TEST(HostBlockPool, OnlyBlocksAtMostAQuarterLargerAreReused) {
  CountingPool p;
  {
    at::Tensor big = p.pool.take(1 << 20);
    at::Tensor small = p.pool.take(4096);
  }
  EXPECT_EQ(p.made, 2);
  { at::Tensor close = p.pool.take((1 << 20) - 100000); }  // within a quarter: the cached MiB
  EXPECT_EQ(p.made, 2);
  { at::Tensor far = p.pool.take(200000); }  // the MiB is more than a quarter larger
  EXPECT_EQ(p.made, 3);
}

TEST(HostBlockPool, ABlockInUseIsNeverHandedOutTwice) {
  CountingPool p;
  at::Tensor a = p.pool.take(8192);
  at::Tensor part = tensor_over(a, a.dtype(), 100, {10});  // a tensor over part of it keeps it
  a = at::Tensor();
  at::Tensor b = p.pool.take(8192);
  EXPECT_NE(b.data_ptr(), part.data_ptr<uint8_t>() - 100);
  EXPECT_EQ(p.made, 2);
}

TEST(HostBlockPool, CachedBytesNeverExceedThePeakInUse) {
  CountingPool p;
  {
    at::Tensor a = p.pool.take(3 * 4096);
    at::Tensor b = p.pool.take(2 * 4096);
  }  // peak in use: 5 pages
  EXPECT_EQ(p.pool.cached_bytes(), 5 * 4096);
  // Other sizes, one at a time: each new block pushes the oldest cached out.
  for (int pages = 6; pages < 40; pages += 3) {
    at::Tensor t = p.pool.take(pages * 4096);
    t = at::Tensor();
    EXPECT_LE(p.pool.cached_bytes(), std::max<int64_t>(5, pages) * 4096);
  }
  p.pool.release_cached();
  EXPECT_EQ(p.pool.cached_bytes(), 0);
}

TEST(HostBlockPool, DownloadsLayTheirRunsInPoolBlocks) {
  CountingPool p;
  std::vector<at::Tensor> device = {at::ones({3}), at::ones({5}, at::kDouble), at::full({300000}, 2.0),
                                    at::ones({0, 4}, at::kInt)};
  for (int iteration = 0; iteration < 3; ++iteration) {
    DownloadBatch batch = plan_download(device, [&](int64_t bytes) { return p.pool.take(bytes); });
    for (size_t i = 0; i < device.size(); ++i) {
      EXPECT_EQ(batch.host[i].sizes(), device[i].sizes());
      EXPECT_EQ(batch.host[i].scalar_type(), device[i].scalar_type());
      batch.host[i].copy_(device[i]);
      EXPECT_TRUE(batch.host[i].equal(device[i]));
    }
  }
  EXPECT_EQ(p.made, 3) << "three runs (float, double, the large tensor), made once for three iterations; "
                          "an empty tensor needs no block";
}

TEST(HostHandoff, ATakenSlotLetsItsHostValueGo) {
  Call call;
  at::Tensor value = at::ones({4});
  Slot slot;
  call.publish(slot, Slot{value, -1, nullptr, true});
  const Slot taken = call.take(slot);
  EXPECT_TRUE(taken.value.toTensor().is_same(value));
  EXPECT_TRUE(slot.value.isNone()) << "the call no longer holds the host copy";
  EXPECT_EQ(value.use_count(), 2) << "held by `value` and `taken` only";
}

TEST(HostHandoff, AnFp32GradientSharingADownloadRunIsCopiedOutOfIt) {
  at::Tensor run = at::zeros({1 << 16});  // a download run's buffer
  at::Tensor part = tensor_over(run, run.dtype(), 1000, {10});
  part.fill_(3);
  at::Tensor own = at::full({7}, 2.0);
  Call call;
  call.grads = {{{0, part}, {1, own}}};
  GradientSums sums({at::kFloat, at::kFloat});
  sums.add(call.take_gradients());
  EXPECT_EQ(sums.by_id()[0].storage().nbytes(), 10 * sizeof(float)) << "not the whole run";
  EXPECT_TRUE(sums.by_id()[0].equal(part));
  EXPECT_TRUE(sums.by_id()[1].is_same(own)) << "memory of its own is kept as it is, not copied";
  EXPECT_TRUE(call.grads.empty()) << "taken out of the call";
}

}  // namespace
}  // namespace roundpipe
