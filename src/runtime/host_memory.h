// Host memory of an exact size for the engine's long-lived parameter slab: an
// anonymous mapping, so no allocator rounds it up (torch's pinned allocator
// rounds to a power of two) and freeing it returns it to the system at once.
// Its pages are faulted in by parallel threads when it is made: faulting is
// the slow part of a large allocation (about 10 us per 4 KiB page on some
// machines), which one thread pays page by page for a whole model.
//
// Thread-safety: thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace roundpipe {

// A uint8 CPU tensor of exactly `bytes` zeroed bytes at the start of a
// private anonymous mapping (whole pages), every page resident.
// `before_unmap(data)` runs when the tensor's storage goes, before the
// mapping is removed (to unregister it from a driver). c10::Error when the
// system refuses the mapping.
at::Tensor mapped_bytes(int64_t bytes, std::function<void(void*)> before_unmap = {});

// Keeps the pages of a mapping made by mapped_bytes out of child processes
// (MADV_DONTFORK): a fork() copies page-locked pages eagerly, so a DataLoader
// worker forked from a training process would copy the whole page-locked
// slab. The child has no such pages: it must not touch the tensor.
// c10::Error when the system refuses.
void keep_out_of_forks(const at::Tensor& mapped);

// The threads mapped_bytes uses to fault in `bytes`: one per 64 MiB, at
// most one per core and 16.
int fault_in_threads(int64_t bytes);

// The whole pages covering the byte ranges (address, bytes), overlapping or
// touching ones merged, in address order: what page-locking those ranges
// in place registers (a page can be registered once; small tensors of the
// heap share pages).
std::vector<std::pair<uintptr_t, int64_t>> covering_pages(std::vector<std::pair<uintptr_t, int64_t>> ranges);

}  // namespace roundpipe
