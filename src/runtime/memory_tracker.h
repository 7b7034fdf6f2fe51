// Per-device accounting of host memory used by CPU virtual devices.
//
// A CPU allocator is installed once (c10::SetCPUAllocator). Every allocation
// made on a thread that has a MemoryCounter set (a virtual device's worker) is
// charged to that counter until the memory is freed, on whatever thread that
// happens. This counts everything a device's work allocates: uploaded
// parameters, activations, autograd buffers, gradients.
//
// Thread-safety: all functions are thread-safe; counters live for the process.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace roundpipe {

class MemoryCounter {
 public:
  // Charges `bytes` about to be allocated. Throws c10::Error ("out of
  // memory", charging nothing) when they would exceed the capacity, or when
  // an injected allocation failure is due.
  void add(int64_t bytes);
  void sub(int64_t bytes) { current_.fetch_sub(bytes, std::memory_order_relaxed); }
  int64_t current() const { return current_.load(std::memory_order_relaxed); }
  int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  void reset_peak() { peak_.store(current(), std::memory_order_relaxed); }

  // Bytes the counter may hold at most (0: unlimited).
  void set_capacity(int64_t bytes) { capacity_.store(bytes, std::memory_order_relaxed); }
  int64_t capacity() const { return capacity_.load(std::memory_order_relaxed); }
  // Makes the nth allocation from now fail (once); 0 disarms. For tests,
  // through FaultInjectingDevice::inject_fault.
  void fail_allocation(int64_t nth) { fail_in_.store(nth, std::memory_order_relaxed); }

  std::string name;  // shown in out-of-memory errors

 private:
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> capacity_{0};
  std::atomic<int64_t> fail_in_{0};
};

// Installs the accounting CPU allocator (idempotent).
void install_tracking_cpu_allocator();

// The counter charged for allocations on this thread (nullptr: none).
MemoryCounter* current_memory_counter();

// Sets this thread's counter for the scope; restores the previous one after.
class MemoryCounterScope {
 public:
  explicit MemoryCounterScope(MemoryCounter* counter);
  ~MemoryCounterScope();
  MemoryCounterScope(const MemoryCounterScope&) = delete;
  MemoryCounterScope& operator=(const MemoryCounterScope&) = delete;

 private:
  MemoryCounter* previous_;
};

}  // namespace roundpipe
