#include "runtime/memory_tracker.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <c10/util/Exception.h>
#include <mutex>

namespace roundpipe {
namespace {

thread_local MemoryCounter* tls_counter = nullptr;

// Each block carries a header with its counter and size, so that the data
// pointer is also the deleter's context (raw_allocate keeps working) and the
// free side needs no lookup. 64 bytes keep the data 64-byte aligned.
struct BlockHeader {
  MemoryCounter* counter;
  int64_t bytes;
};
constexpr size_t kHeaderBytes = 64;
static_assert(sizeof(BlockHeader) <= kHeaderBytes, "header must fit");

void free_block(void* data) {
  if (data == nullptr) return;
  auto* base = static_cast<char*>(data) - kHeaderBytes;
  auto* header = reinterpret_cast<BlockHeader*>(base);
  if (header->counter != nullptr) header->counter->sub(header->bytes);
  c10::free_cpu(base);
}

class TrackingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (tls_counter != nullptr) tls_counter->add(static_cast<int64_t>(nbytes));  // may throw: nothing held yet
    auto* base = static_cast<char*>(c10::alloc_cpu(nbytes + kHeaderBytes));
    auto* header = reinterpret_cast<BlockHeader*>(base);
    header->counter = tls_counter;
    header->bytes = static_cast<int64_t>(nbytes);
    void* data = base + kHeaderBytes;
    return {data, data, &free_block, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

void MemoryCounter::add(int64_t bytes) {
  int64_t due = fail_in_.load(std::memory_order_relaxed);
  while (due > 0 && !fail_in_.compare_exchange_weak(due, due - 1, std::memory_order_relaxed)) {
  }
  TORCH_CHECK(due != 1, "injected fault: allocation of ", bytes, " bytes failed on ", name);
  int64_t now = current_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  const int64_t capacity = capacity_.load(std::memory_order_relaxed);
  if (capacity > 0 && now > capacity) {
    current_.fetch_sub(bytes, std::memory_order_relaxed);
    TORCH_CHECK(false, name, " is out of memory: tried to allocate ", bytes, " bytes with ", now - bytes,
                " of its ", capacity, " bytes in use");
  }
  int64_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void install_tracking_cpu_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    static TrackingCpuAllocator allocator;
    // Priority above the default allocator's, so ours is the one in use.
    c10::SetCPUAllocator(&allocator, /*priority=*/1);
  });
}

MemoryCounter* current_memory_counter() { return tls_counter; }

MemoryCounterScope::MemoryCounterScope(MemoryCounter* counter) : previous_(tls_counter) {
  tls_counter = counter;
}

MemoryCounterScope::~MemoryCounterScope() { tls_counter = previous_; }

}  // namespace roundpipe
