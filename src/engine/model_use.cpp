#include "engine/model_use.h"

#include <c10/util/Exception.h>

#include "engine/optimizer_thread.h"
#include "util/interrupt.h"
#include "util/worker_thread.h"

namespace roundpipe {
namespace {

thread_local const UserCodeScope* innermost = nullptr;

}  // namespace

UserCodeScope::UserCodeScope(const std::string& model, const char* what, int64_t layer)
    : model_(model), what_(what), layer_(layer), outer_(innermost) {
  innermost = this;
}

UserCodeScope::~UserCodeScope() { innermost = outer_; }

const UserCodeScope* UserCodeScope::current() { return innermost; }

std::string UserCodeScope::describe() const {
  const std::string of = " of model '" + model_ + "'";
  if (layer_ >= 0) return std::string(what_) + " " + std::to_string(layer_) + of;
  return what_ + of;
}

void ModelUseLock::enter(const char* call) {
  const std::string head = "RoundPipe model '" + model_ + "': " + call + "() ";
  if (const UserCodeScope* scope = UserCodeScope::current()) {
    const bool step_fn = on_optimizer_thread();
    TORCH_CHECK(false, head, "was called from inside ", scope->describe(), ", which runs on ",
                step_fn ? "the optimizer thread" : "a device thread",
                " that this call would wait for. Call it from the training loop instead, after ",
                step_fn ? "model.step(...) returns (what it sees then includes that step)"
                        : "forward_backward(...) returns");
  }
  TORCH_CHECK(!WorkerThread::on_a_worker_thread(), head,
              "was called from one of the engine's threads (an optimizer or device thread), which "
              "this call could wait for; call it from the training loop instead");
  std::unique_lock<std::mutex> lock(mu_);
  const std::thread::id self = std::this_thread::get_id();
  if (owner_ == self) {
    ++depth_;
    return;
  }
  // Another thread's call: wait for its end, as a lock (Ctrl-C still works).
  while (depth_ > 0) {
    if (!interruptible()) {
      cv_.wait(lock, [&] { return depth_ == 0; });
      break;
    }
    cv_.wait_for(lock, kInterruptPollPeriod, [&] { return depth_ == 0; });
    if (depth_ == 0) break;
    lock.unlock();
    std::exception_ptr interrupt = poll_interrupt();
    if (interrupt) std::rethrow_exception(interrupt);
    lock.lock();
  }
  owner_ = self;
  depth_ = 1;
}

void ModelUseLock::leave() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--depth_ > 0) return;
    owner_ = std::thread::id();
  }
  cv_.notify_one();
}

}  // namespace roundpipe
