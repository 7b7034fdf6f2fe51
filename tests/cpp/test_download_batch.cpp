// The host memory of a download: small tensors of a dtype share runs, larger
// ones have their own.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "runtime/download_batch.h"

namespace roundpipe {
namespace {

bool shares_storage(const at::Tensor& a, const at::Tensor& b) { return a.storage().is_alias_of(b.storage()); }

TEST(DownloadBatch, SmallTensorsOfADtypeShareARunAndLargerOnesAreAlone) {
  const at::Tensor a = at::randn({2, 3});
  const at::Tensor ints = at::arange(4, at::kLong);
  const at::Tensor medium = at::randn({1000});   // 4000 bytes: not small
  const at::Tensor strided = at::randn({3, 2}).t();  // not contiguous
  const at::Tensor half = at::randn({5}).to(at::kBFloat16);
  const at::Tensor scalar = at::randn({});
  const std::vector<at::Tensor> batch_of{a, ints, medium, at::Tensor(), strided, half, scalar};
  DownloadBatch batch = plan_download(batch_of, /*host_bytes=*/nullptr, /*gather_below=*/2048, /*max_run_bytes=*/1 << 20);

  ASSERT_EQ(batch.host.size(), batch_of.size());
  EXPECT_FALSE(batch.host[3].defined());
  for (size_t i : {0, 1, 2, 4, 5, 6}) {
    EXPECT_EQ(batch.host[i].sizes(), batch_of[i].sizes()) << i;
    EXPECT_EQ(batch.host[i].scalar_type(), batch_of[i].scalar_type()) << i;
    EXPECT_TRUE(batch.host[i].is_contiguous()) << i;
    EXPECT_FALSE(batch.host[i].is_view()) << i;
  }
  EXPECT_TRUE(shares_storage(batch.host[0], batch.host[4]));
  EXPECT_TRUE(shares_storage(batch.host[0], batch.host[6]));
  EXPECT_FALSE(shares_storage(batch.host[0], batch.host[2]));
  EXPECT_FALSE(shares_storage(batch.host[0], batch.host[1]));
  EXPECT_FALSE(shares_storage(batch.host[0], batch.host[5]));
  // The medium tensor's memory is its exact size.
  EXPECT_EQ(batch.host[2].storage().nbytes(), medium.nbytes());

  // The small floats (a, strided, scalar) in one run, in batch order; the
  // medium one, the longs and the bfloat16s in runs of their own.
  ASSERT_EQ(batch.runs.size(), 4u);
  std::vector<std::vector<size_t>> members;
  for (const auto& run : batch.runs) members.push_back(run.members);
  EXPECT_EQ(members, (std::vector<std::vector<size_t>>{{0, 4, 6}, {1}, {2}, {5}}));
  // A run's buffer is its members' memory, back to back; a run of one has
  // no buffer besides its tensor.
  for (const auto& run : batch.runs) {
    if (run.members.size() == 1) {
      EXPECT_FALSE(run.into.defined());
      continue;
    }
    int64_t numel = 0;
    for (size_t i : run.members) {
      const at::Tensor& host = batch.host[i];
      EXPECT_EQ(static_cast<const char*>(host.data_ptr()) - static_cast<const char*>(run.into.data_ptr()),
                numel * host.element_size());
      numel += host.numel();
    }
    EXPECT_EQ(run.into.numel(), numel);
    EXPECT_TRUE(shares_storage(run.into, batch.host[run.members[0]]));
  }

  // Copied as an accelerator does, every tensor holds its value.
  for (const auto& run : batch.runs) {
    if (run.members.size() == 1) {
      batch.host[run.members[0]].copy_(batch_of[run.members[0]]);
      continue;
    }
    std::vector<at::Tensor> flat;
    for (size_t i : run.members) flat.push_back(batch_of[i].reshape({-1}));
    run.into.copy_(at::cat(flat));
  }
  for (size_t i : {0, 1, 2, 4, 5, 6}) EXPECT_TRUE(batch.host[i].equal(batch_of[i])) << i;

  // Each is a tensor of its own: changing or detaching one in place leaves
  // its neighbours as they were.
  batch.host[0].add_(1);
  batch.host[0].detach_();
  EXPECT_TRUE(batch.host[4].equal(strided));
  EXPECT_TRUE(batch.host[6].equal(scalar));
}

TEST(DownloadBatch, RunsStayWithinTheirSizeAndKeepToOneSourceDevice) {
  const std::vector<at::Tensor> small{at::randn({6}), at::randn({6}), at::randn({6})};  // 24 bytes each
  DownloadBatch capped = plan_download(small, nullptr, /*gather_below=*/1024, /*max_run_bytes=*/48);
  ASSERT_EQ(capped.runs.size(), 2u);
  EXPECT_EQ(capped.runs[0].members, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(capped.runs[1].members, (std::vector<size_t>{2}));
  DownloadBatch alone = plan_download(small, nullptr, /*gather_below=*/0, /*max_run_bytes=*/0);
  ASSERT_EQ(alone.runs.size(), 3u);
  EXPECT_FALSE(shares_storage(alone.host[0], alone.host[2]));
  EXPECT_TRUE(plan_download({}, nullptr, 1024, 1024).runs.empty());
  // A tensor on another device never joins a run (a gather is one device's).
  const std::vector<at::Tensor> mixed{at::randn({4}), at::empty({4}, at::TensorOptions().device(at::kMeta)), at::randn({4})};
  DownloadBatch split = plan_download(mixed, nullptr, 1024, 1024);
  ASSERT_EQ(split.runs.size(), 2u);
  EXPECT_EQ(split.runs[0].members, (std::vector<size_t>{0, 2}));
  EXPECT_EQ(split.runs[1].members, (std::vector<size_t>{1}));
}

}  // namespace
}  // namespace roundpipe
