// What a step takes of the call in flight (Pipeline::hand_to_step): the
// call's gradients, which the step sums once the call has finished, and the
// order in which the call stops reading the model's parameters, which a
// delayed step follows to write them back layer by layer. The call itself
// stays the pipeline's: its timings, trace and buffers are applied by the
// pipeline once the step says the call is done (docs/design/engine.md, "A
// call's life").
//
// Thread-safety: wait_read(), wait() and take() belong to the optimizer
// thread running the step; done() may be asked from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "engine/gradient_sums.h"

namespace roundpipe {

class Call;

class GradientsInFlight {
 public:
  explicit GradientsInFlight(std::shared_ptr<Call> call);
  GradientsInFlight(const GradientsInFlight&) = delete;
  GradientsInFlight& operator=(const GradientsInFlight&) = delete;

  // Blocks until nothing of the call reads layer `layer`'s host parameters.
  void wait_read(int64_t layer) const;
  // Blocks until every job of the call finished and every copy it issued
  // completed; rethrows the call's failure (then it has no gradients). The
  // call is done with afterwards, either way.
  void wait();
  // After a successful wait(): the call's gradients, moved out of it.
  CallGradients take();
  // wait() returned: the pipeline may apply the rest of the call.
  bool done() const { return done_.load(std::memory_order_acquire); }

 private:
  std::shared_ptr<Call> call_;
  std::atomic<bool> done_{false};
};

}  // namespace roundpipe
