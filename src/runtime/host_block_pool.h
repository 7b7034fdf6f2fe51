// Host memory blocks reused by size: page-locked memory is slow to make
// (mapping, faulting in, registering with the driver) and torch's pinned
// allocator rounds every request up to a power of two and keeps it cached,
// up to twice the bytes a model's downloads need. A training loop downloads
// the same sizes every iteration, so blocks of exact sizes (whole pages)
// kept after use serve the next iteration without rounding.
//
// A block returns to the pool when the last tensor over it goes. Whoever
// copies into or out of a block keeps a tensor over it until the copy's fence
// has completed (device.h: every copy holds its source and destination), so
// a block is never handed out again while a copy still uses it.
//
// The pool keeps at most as many bytes cached as were in use at once at the
// peak; beyond that, the blocks given back longest ago are freed.
//
// Thread-safety: thread-safe. Blocks may be given back from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace roundpipe {

class HostBlockPool {
 public:
  // `make(bytes)`: a new uint8 CPU tensor of exactly `bytes` bytes (whole
  // pages are asked for).
  explicit HostBlockPool(std::function<at::Tensor(int64_t bytes)> make);
  ~HostBlockPool();
  HostBlockPool(const HostBlockPool&) = delete;
  HostBlockPool& operator=(const HostBlockPool&) = delete;

  // A uint8 CPU tensor of `bytes` bytes over a block of the pool: a cached
  // block of at least that size and at most a quarter larger, or a new one.
  at::Tensor take(int64_t bytes);

  int64_t in_use_bytes() const;  // blocks with a tensor over them
  int64_t cached_bytes() const;  // blocks kept for reuse
  // Frees every cached block.
  void release_cached();

 private:
  struct State;
  std::shared_ptr<State> state_;  // shared with the blocks' deleters
};

}  // namespace roundpipe
