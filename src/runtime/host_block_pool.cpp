#include "runtime/host_block_pool.h"

#include <ATen/ATen.h>

#include <list>
#include <map>
#include <mutex>
#include <utility>

namespace roundpipe {

namespace {
constexpr int64_t kPage = 4096;
}

struct HostBlockPool::State {
  std::function<at::Tensor(int64_t)> make;
  mutable std::mutex mu;
  // Cached blocks by size; each also in `order`, oldest given back first.
  std::multimap<int64_t, std::list<at::Tensor>::iterator> by_size;
  std::list<at::Tensor> order;
  int64_t cached = 0;
  int64_t in_use = 0;
  int64_t peak_in_use = 0;

  // Called with mu held: frees the oldest cached blocks beyond the peak.
  void trim() {
    while (cached > peak_in_use && !order.empty()) {
      const at::Tensor& oldest = order.front();
      const int64_t bytes = oldest.numel();
      for (auto it = by_size.lower_bound(bytes); it != by_size.end() && it->first == bytes; ++it) {
        if (it->second == order.begin()) {
          by_size.erase(it);
          break;
        }
      }
      cached -= bytes;
      order.pop_front();
    }
  }
};

HostBlockPool::HostBlockPool(std::function<at::Tensor(int64_t bytes)> make) : state_(std::make_shared<State>()) {
  state_->make = std::move(make);
}

HostBlockPool::~HostBlockPool() = default;

at::Tensor HostBlockPool::take(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "HostBlockPool::take: bytes must be >= 0, got ", bytes);
  const int64_t want = (bytes + kPage - 1) / kPage * kPage;
  at::Tensor block;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->by_size.lower_bound(want);
    if (it != state_->by_size.end() && it->first <= want + want / 4) {
      block = std::move(*it->second);
      state_->order.erase(it->second);
      state_->by_size.erase(it);
      state_->cached -= block.numel();
    }
  }
  if (!block.defined()) block = state_->make(want);  // outside the lock: slow
  const int64_t size = block.numel();
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->in_use += size;
    state_->peak_in_use = std::max(state_->peak_in_use, state_->in_use);
  }
  // The block comes back when the tensor's storage goes, wherever that is.
  std::weak_ptr<State> pool = state_;
  void* data = block.data_ptr();
  return at::from_blob(
      data, {bytes},
      [pool, block](void*) mutable {
        if (std::shared_ptr<State> s = pool.lock()) {
          std::lock_guard<std::mutex> lock(s->mu);
          s->in_use -= block.numel();
          s->order.push_back(std::move(block));
          s->by_size.emplace(s->order.back().numel(), std::prev(s->order.end()));
          s->cached += s->order.back().numel();
          s->trim();
        }
      },
      at::TensorOptions().dtype(at::kByte));
}

int64_t HostBlockPool::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->in_use;
}

int64_t HostBlockPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->cached;
}

void HostBlockPool::release_cached() {
  std::list<at::Tensor> freed;  // freed outside the lock
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->by_size.clear();
  freed.swap(state_->order);
  state_->cached = 0;
}

}  // namespace roundpipe
