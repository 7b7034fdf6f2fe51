// What the accelerator backend needs from CUDA beyond c10's device-generic
// API: page-locked host memory of an exact size (torch's pinned allocator
// rounds every block up to a power of two) and the caching allocator's
// statistics. Built from cuda_memory.cpp against a CUDA torch, else from
// cuda_memory_unavailable.cpp, whose functions say CUDA is not built in.
//
// Thread-safety: thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace roundpipe {
namespace cuda {

// True when roundpipe was built against a CUDA torch (whether or not a GPU
// is present).
bool built_with_cuda();

// A uint8 CPU tensor of exactly `bytes` bytes of page-locked memory: a
// mapping of host_memory.h (pages faulted in by parallel threads) registered
// with CUDA in one cudaHostRegister; unregistered and unmapped when its
// storage goes. c10::Error if CUDA refuses.
at::Tensor page_locked_bytes(int64_t bytes);

// Page-locks `bytes` of existing host memory at `ptr` in place
// (cudaHostRegister): true; false when some of it was page-locked already
// (by its owner or another model: left as it is); c10::Error saying so if
// CUDA refuses otherwise.
// unregister_page_locked undoes it (errors ignored: called from destructors).
bool register_page_locked(void* ptr, int64_t bytes);
void unregister_page_locked(void* ptr);

// Page-locked host bytes now: roundpipe's (slabs, memory registered in
// place) and torch's pinned allocator's (blocks in use or cached).
int64_t page_locked_host_bytes();

// The caching allocator's bytes in use on CUDA device `index`, now and at
// the peak since the last reset; and the bytes it holds from CUDA (in use
// or cached), at the peak. Zero before the allocator's first use.
int64_t allocated_bytes(int index);
int64_t peak_allocated_bytes(int index);
int64_t peak_reserved_bytes(int index);
void reset_peak_allocated_bytes(int index);

}  // namespace cuda
}  // namespace roundpipe
