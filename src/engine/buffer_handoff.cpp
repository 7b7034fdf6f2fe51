#include "engine/buffer_handoff.h"

#include <c10/util/Exception.h>

namespace roundpipe {

BufferHandoff::BufferHandoff(int64_t call_id, int64_t num_layers)
    : call_id_(call_id), published_(num_layers, 0), layers_(num_layers) {}

void BufferHandoff::publish(int64_t layer, std::vector<at::Tensor> values, FencePtr downloaded) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    layers_.at(layer) = Published{std::move(values), std::move(downloaded)};
    published_.at(layer) = 1;
  }
  cv_.notify_all();
}

void BufferHandoff::fail() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed_ = true;
  }
  cv_.notify_all();
}

BufferHandoff::Published BufferHandoff::wait(int64_t layer) const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return published_.at(layer) || failed_; });
  TORCH_CHECK(published_[layer], "the buffers of layer ", layer, " come from the previous call, which failed");
  return layers_[layer];
}

}  // namespace roundpipe
