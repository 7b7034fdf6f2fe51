// The gradients of the call in flight, handed to a step (gradients_in_flight.h).
#include "engine/gradients_in_flight.h"

#include "engine/call.h"

namespace roundpipe {

GradientsInFlight::GradientsInFlight(std::shared_ptr<Call> call) : call_(std::move(call)) {}

void GradientsInFlight::wait_read(int64_t layer) const { call_->wait_read(layer); }

void GradientsInFlight::wait() {
  struct MarkDone {
    std::atomic<bool>& done;
    ~MarkDone() { done.store(true, std::memory_order_release); }
  } mark{done_};
  call_->wait_all();
}

CallGradients GradientsInFlight::take() { return call_->take_gradients(); }

}  // namespace roundpipe
