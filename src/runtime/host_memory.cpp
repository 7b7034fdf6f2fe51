#include "runtime/host_memory.h"

#include <ATen/ATen.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

namespace roundpipe {
namespace {

int64_t page_size() {
  static const int64_t size = ::sysconf(_SC_PAGESIZE);
  return size;
}

// Writes a zero into every page of [begin, end) (page-aligned, fresh zero
// memory, so nothing changes but residency).
void fault_in(char* begin, char* end) {
  for (char* p = begin; p < end; p += page_size()) *reinterpret_cast<volatile char*>(p) = 0;
}

void fault_in_parallel(char* data, int64_t bytes) {
  const int threads = fault_in_threads(bytes);
  const int64_t pages = bytes / page_size();
  auto chunk = [&](int i) { return data + pages * i / threads * page_size(); };
  std::vector<std::thread> helpers;
  for (int i = 1; i < threads; ++i) {
    try {
      helpers.emplace_back(fault_in, chunk(i), chunk(i + 1));
    } catch (const std::system_error&) {
      fault_in(chunk(i), chunk(i + 1));  // no thread to spare: this one does it
    }
  }
  fault_in(chunk(0), chunk(1));
  for (std::thread& t : helpers) t.join();
}

}  // namespace

int fault_in_threads(int64_t bytes) {
  constexpr int64_t kBytesPerThread = int64_t{64} << 20;
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<int>(std::clamp<int64_t>(bytes / kBytesPerThread, 1, std::min<int64_t>(cores, 16)));
}

std::vector<std::pair<uintptr_t, int64_t>> covering_pages(std::vector<std::pair<uintptr_t, int64_t>> ranges) {
  const auto page = static_cast<uintptr_t>(page_size());
  std::vector<std::pair<uintptr_t, uintptr_t>> pages;  // [begin, end)
  for (const auto& [address, bytes] : ranges) {
    if (bytes <= 0) continue;
    pages.emplace_back(address / page * page, (address + static_cast<uintptr_t>(bytes) + page - 1) / page * page);
  }
  std::sort(pages.begin(), pages.end());
  std::vector<std::pair<uintptr_t, int64_t>> out;
  for (size_t i = 0; i < pages.size();) {
    auto [begin, end] = pages[i];
    for (++i; i < pages.size() && pages[i].first <= end; ++i) end = std::max(end, pages[i].second);
    out.emplace_back(begin, static_cast<int64_t>(end - begin));
  }
  return out;
}

at::Tensor mapped_bytes(int64_t bytes, std::function<void(void*)> before_unmap) {
  TORCH_CHECK_VALUE(bytes >= 0, "mapped_bytes: bytes must be >= 0, got ", bytes);
  const auto options = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  if (bytes == 0) return at::empty({0}, options);
  const int64_t mapped = (bytes + page_size() - 1) / page_size() * page_size();
  void* data = ::mmap(nullptr, static_cast<size_t>(mapped), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(data != MAP_FAILED, "cannot map ", bytes, " bytes of host memory for the model's parameters: ",
              std::strerror(errno));
  fault_in_parallel(static_cast<char*>(data), mapped);
  return at::from_blob(
      data, {bytes},
      [mapped, before_unmap = std::move(before_unmap)](void* p) {
        if (before_unmap) before_unmap(p);
        ::munmap(p, static_cast<size_t>(mapped));
      },
      options);
}

void keep_out_of_forks(const at::Tensor& mapped) {
  if (mapped.nbytes() == 0) return;
  const int64_t bytes = (static_cast<int64_t>(mapped.nbytes()) + page_size() - 1) / page_size() * page_size();
  TORCH_CHECK(::madvise(mapped.data_ptr(), static_cast<size_t>(bytes), MADV_DONTFORK) == 0,
              "cannot keep ", bytes, " bytes of page-locked host memory out of child processes: ",
              std::strerror(errno));
}

}  // namespace roundpipe
