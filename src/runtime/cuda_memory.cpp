// CUDA side of runtime/cuda_memory.h (built against a CUDA torch).
#include "runtime/cuda_memory.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

namespace roundpipe {
namespace cuda {

bool built_with_cuda() { return true; }

at::Tensor page_locked_bytes(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes >= 0, "page_locked_bytes: bytes must be >= 0, got ", bytes);
  void* ptr = nullptr;
  if (bytes > 0) {
    const cudaError_t err = cudaHostAlloc(&ptr, static_cast<size_t>(bytes), cudaHostAllocPortable);
    TORCH_CHECK(err == cudaSuccess, "cudaHostAlloc of ", bytes,
                " page-locked bytes failed: ", cudaGetErrorString(err));
  }
  return at::from_blob(
      ptr, {bytes},
      [](void* p) {
        if (p != nullptr) cudaFreeHost(p);
      },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

void register_page_locked(void* ptr, int64_t bytes) {
  const cudaError_t err = cudaHostRegister(ptr, static_cast<size_t>(bytes), cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "pin_model='register': cudaHostRegister of ", bytes, " bytes of parameter memory failed: ",
                cudaGetErrorString(err), "; use pin_model='alloc' (copy into page-locked arenas) or 'off'");
  }
}

void unregister_page_locked(void* ptr) {
  if (cudaHostUnregister(ptr) != cudaSuccess) (void)cudaGetLastError();
}

bool is_page_locked(const void* ptr) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error state of the query
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

namespace {

// allocated_bytes[0]: the aggregate over the allocator's pools (StatType's
// first entry; where the type lives moved between torch versions).
struct Allocated {
  int64_t current, peak;
};
Allocated allocated(int index) {
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return {stats.allocated_bytes[0].current, stats.allocated_bytes[0].peak};
}

}  // namespace

int64_t allocated_bytes(int index) { return allocated(index).current; }
int64_t peak_allocated_bytes(int index) { return allocated(index).peak; }
void reset_peak_allocated_bytes(int index) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
}

}  // namespace cuda
}  // namespace roundpipe
