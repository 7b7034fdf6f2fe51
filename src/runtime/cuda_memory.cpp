// CUDA side of runtime/cuda_memory.h (built against a CUDA torch).
#include "runtime/cuda_memory.h"

#include <ATen/ATen.h>
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

#include <mutex>
#include <unordered_map>

#include "runtime/host_memory.h"

namespace roundpipe {
namespace cuda {

namespace {

// The host memory roundpipe has page-locked: address -> bytes. Never
// destroyed: a model may outlive static destruction.
struct Registered {
  std::mutex mu;
  std::unordered_map<const void*, int64_t> bytes;
};
Registered& registered() {
  static auto* r = new Registered;
  return *r;
}

// Page-locks [ptr, ptr + bytes) and records it; false (CUDA's error cleared,
// `err` set) when CUDA refuses.
bool lock_pages(void* ptr, int64_t bytes, cudaError_t& err) {
  err = cudaHostRegister(ptr, static_cast<size_t>(bytes), cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  std::lock_guard<std::mutex> lock(registered().mu);
  registered().bytes[ptr] = bytes;
  return true;
}

// True when `ptr` lies in page-locked host memory known to CUDA (allocated
// page-locked, e.g. by tensor.pin_memory(), or registered).
bool is_page_locked(const void* ptr) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

}  // namespace

bool built_with_cuda() { return true; }

at::Tensor page_locked_bytes(int64_t bytes) {
  // Faulted in by parallel threads, then page-locked in one call: one
  // registration, so a copy may span any range of it, and the driver's
  // global lock is taken once, after the slow part.
  at::Tensor out = mapped_bytes(bytes, [](void* p) { unregister_page_locked(p); });
  keep_out_of_forks(out);  // before page-locking: a fork would copy every locked page
  cudaError_t err = cudaSuccess;
  TORCH_CHECK(bytes == 0 || lock_pages(out.data_ptr(), bytes, err), "page-locking ", bytes,
              " bytes of host memory failed: ", cudaGetErrorString(err),
              " (the page-locked memory a process may have can be limited: ulimit -l, a container's memory "
              "limit); pin_model='off' keeps the model's parameters in unpinned memory");
  return out;
}

bool register_page_locked(void* ptr, int64_t bytes) {
  if (is_page_locked(ptr)) return false;
  cudaError_t err = cudaSuccess;
  if (lock_pages(ptr, bytes, err)) return true;
  if (err == cudaErrorHostMemoryAlreadyRegistered) return false;
  TORCH_CHECK(false, "pin_model='register': cudaHostRegister of ", bytes, " bytes of parameter memory failed: ",
              cudaGetErrorString(err), "; use pin_model='alloc' (copy into page-locked arenas) or 'off'");
}

void unregister_page_locked(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(registered().mu);
    if (registered().bytes.erase(ptr) == 0) return;  // never locked (its registration failed)
  }
  if (cudaHostUnregister(ptr) != cudaSuccess) (void)cudaGetLastError();
}

int64_t page_locked_host_bytes() {
  int64_t own = 0;
  {
    std::lock_guard<std::mutex> lock(registered().mu);
    for (const auto& [ptr, bytes] : registered().bytes) own += bytes;
  }
  return own + at::getHostAllocator(at::kCUDA)->get_stats().allocated_bytes.current;
}

namespace {

// allocated_bytes[0]: the aggregate over the allocator's pools (StatType's
// first entry; where the type lives moved between torch versions).
struct Stats {
  int64_t allocated, peak_allocated, peak_reserved;
};
// The allocator is set up at CUDA's lazy initialization, and its statistics
// refuse a device before that ("did you call init?"): nothing was allocated.
bool allocator_ready(int index) {
  return index >= 0 && c10::cuda::CUDACachingAllocator::get()->initialized();
}
Stats stats_of(int index) {
  if (!allocator_ready(index)) return {0, 0, 0};
  try {
    const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
    return {s.allocated_bytes[0].current, s.allocated_bytes[0].peak, s.reserved_bytes[0].peak};
  } catch (const c10::Error&) {
    return {0, 0, 0};  // this device's allocator is not set up yet
  }
}

}  // namespace

int64_t allocated_bytes(int index) { return stats_of(index).allocated; }
int64_t peak_allocated_bytes(int index) { return stats_of(index).peak_allocated; }
int64_t peak_reserved_bytes(int index) { return stats_of(index).peak_reserved; }
void reset_peak_allocated_bytes(int index) {
  if (!allocator_ready(index)) return;
  try {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
  } catch (const c10::Error&) {
    // not set up yet: no peak to reset
  }
}

}  // namespace cuda
}  // namespace roundpipe
