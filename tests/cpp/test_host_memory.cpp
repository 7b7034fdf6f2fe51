// mapped_bytes: the exact-size host memory of the parameter slab, its pages
// faulted in when it is made, unmapped when its storage goes.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <sys/wait.h>

#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/host_memory.h"

namespace roundpipe {
namespace {

const int64_t kPage = ::sysconf(_SC_PAGESIZE);

// How many of the pages of [data, data + bytes) are resident.
int64_t resident_pages(const void* data, int64_t bytes) {
  const int64_t pages = (bytes + kPage - 1) / kPage;
  std::vector<unsigned char> in_core(static_cast<size_t>(pages));
  EXPECT_EQ(::mincore(const_cast<void*>(data), static_cast<size_t>(bytes), in_core.data()), 0);
  int64_t resident = 0;
  for (unsigned char c : in_core) resident += c & 1;
  return resident;
}

TEST(HostMemory, MappedBytesAreExactZeroedResidentAndUnmappedWithTheirStorage) {
  // Several fault-in threads' worth, and not a whole number of pages.
  const int64_t bytes = (int64_t{3} << 26) + 100;
  void* unmapped = nullptr;
  {
    at::Tensor t = mapped_bytes(bytes, [&](void* p) { unmapped = p; });
    ASSERT_EQ(t.numel(), bytes);
    EXPECT_EQ(t.scalar_type(), at::kByte);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % kPage, 0u);
    EXPECT_EQ(resident_pages(t.data_ptr(), bytes), (bytes + kPage - 1) / kPage)
        << "every page is faulted in when the memory is made";
    EXPECT_EQ(t.sum().item<int64_t>(), 0);
    t.fill_(7);  // the last, partial page is writable too
    EXPECT_EQ(t[bytes - 1].item<int64_t>(), 7);
    at::Tensor view = t.narrow(0, 5, 10);
    const void* data = t.data_ptr();
    t.reset();
    EXPECT_EQ(unmapped, nullptr) << "a view keeps the mapping";
    view.reset();
    EXPECT_EQ(unmapped, data);
  }
}

// The flags /proc/self/smaps gives the mapping that holds `data`.
std::string vm_flags_of(const void* data) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  const auto address = reinterpret_cast<uintptr_t>(data);
  while (std::getline(smaps, line)) {
    uintptr_t begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR " ", &begin, &end) == 2 && line.find(':') > 8) {
      inside = address >= begin && address < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

TEST(HostMemory, KeptOutOfForksTheMappingIsNotCopiedIntoAChild) {
  at::Tensor t = mapped_bytes(3 * kPage + 5);
  const std::string before = vm_flags_of(t.data_ptr());
  ASSERT_FALSE(before.empty()) << "the mapping is in /proc/self/smaps";
  EXPECT_EQ(before.find(" dc"), std::string::npos) << before;
  keep_out_of_forks(t);
  const std::string after = vm_flags_of(t.data_ptr());
  EXPECT_NE(after.find(" dc"), std::string::npos) << "MADV_DONTFORK: " << after;
  // A child really lacks it: mincore on its range fails with ENOMEM there.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    unsigned char in_core[4];
    const int rc = ::mincore(t.data_ptr(), static_cast<size_t>(3 * kPage + 5), in_core);
    ::_exit(rc != 0 && errno == ENOMEM ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child has the parent's pages";
  EXPECT_EQ(t[3 * kPage + 4].item<int64_t>(), 0) << "the parent keeps them";
  keep_out_of_forks(mapped_bytes(0));  // nothing to do
}

TEST(HostMemory, EmptyAndNegativeSizes) {
  EXPECT_EQ(mapped_bytes(0).numel(), 0);
  EXPECT_THROW(mapped_bytes(-1), c10::ValueError);
}

TEST(HostMemory, FaultInThreadsGrowWithTheSizeUpToTheCores) {
  const int64_t mib = int64_t{1} << 20;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_EQ(fault_in_threads(0), 1);
  EXPECT_EQ(fault_in_threads(100 * mib), 1);
  EXPECT_EQ(fault_in_threads(128 * mib), std::min(2, cores));
  EXPECT_EQ(fault_in_threads(int64_t{1} << 40), std::min(16, cores));
}

TEST(HostMemory, CoveringPagesRoundOutToPagesAndMergeWhatOverlapsOrTouches) {
  const uintptr_t p = 1000 * static_cast<uintptr_t>(kPage);
  using Ranges = std::vector<std::pair<uintptr_t, int64_t>>;
  // Two small tensors sharing a page, one touching the next page, one far
  // away, one empty.
  const Ranges ranges = {{p + 5 * kPage, 10}, {p + 100, 64}, {p + 200, 64}, {p + kPage - 8, 16}, {p + 9 * kPage, 0}};
  EXPECT_EQ(covering_pages(ranges), (Ranges{{p, 2 * kPage}, {p + 5 * kPage, kPage}}));
  EXPECT_EQ(covering_pages({{p + kPage, kPage}, {p, kPage}}), (Ranges{{p, 2 * kPage}})) << "touching pages merge";
  EXPECT_TRUE(covering_pages({}).empty());
}

}  // namespace
}  // namespace roundpipe
