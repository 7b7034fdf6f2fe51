// The buffers one call's forward left, layer by layer, for the calls issued
// while it is still running (iteration overlap; docs/guide.md,
// "3. A training loop"): a buffer the forward wrote is ordered like a
// parameter, so the next call uploads what that forward wrote, not the host
// buffers that call will write back only when it is applied; a buffer it did
// not write is the host tensor it was uploaded from, which nothing waits for
// (docs/design/engine.md, "Iteration overlap").
//
// Thread-safety: publish() and fail() on the producing call's device
// workers (fail() also on the user thread), wait() on the consuming calls'
// workers; all of it under one mutex.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "runtime/device.h"

namespace roundpipe {

class BufferHandoff {
 public:
  // For the buffers of `num_layers` layers, made by the call `call_id`.
  BufferHandoff(int64_t call_id, int64_t num_layers);

  int64_t call_id() const { return call_id_; }

  // Layer `layer`'s buffers (host memory) as the producing call's forward
  // left them, valid once `downloaded` completes (null: now): the downloads
  // of those it wrote, the tensors it uploaded the others from.
  void publish(int64_t layer, std::vector<at::Tensor> values, FencePtr downloaded);
  // The producing call failed: waiting for a layer it has not published
  // throws instead of blocking.
  void fail();

  struct Published {
    std::vector<at::Tensor> values;
    FencePtr downloaded;
  };
  // Blocks until layer `layer`'s buffers are published; throws c10::Error
  // when the producing call failed first.
  Published wait(int64_t layer) const;

 private:
  const int64_t call_id_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<char> published_;    // guarded by mu_: [layer]
  std::vector<Published> layers_;  // guarded by mu_: [layer]
  bool failed_ = false;            // guarded by mu_
};

}  // namespace roundpipe
