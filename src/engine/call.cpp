// A call's bookkeeping: values between jobs, the first error, the wait for
// every job and copy.
#include "engine/call.h"

#include "util/interrupt.h"

#include <stdexcept>
#include <typeinfo>

namespace roundpipe {

// ---- Call bookkeeping ----

void Call::init_flow() {
  flow.assign(jobs.size() + 1, std::vector<Slot>(num_microbatch));
  prefetched.assign(jobs.size(), StageTensors());
  losses.assign(num_microbatch, c10::IValue());
  outputs.assign(num_microbatch, c10::IValue());
  grads.assign(jobs.size(), {});
  buffers.assign(jobs.size(), {});
  fences.assign(jobs.size(), {});
  records.assign(jobs.size(), JobRecord());
}

Slot Call::wait(const Slot& slot) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return slot.ready || error_ != nullptr; });
  if (error_ != nullptr) throw Cancelled{};
  return slot;
}

Slot Call::take(Slot& slot) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return slot.ready || error_ != nullptr; });
  if (error_ != nullptr) throw Cancelled{};
  Slot out = slot;
  if (slot.device >= 0) slot.value = c10::IValue();
  return out;
}

void Call::publish(Slot& slot, Slot value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    slot = std::move(value);
    slot.ready = true;
  }
  cv_.notify_all();
}

void Call::fail(std::exception_ptr error, const std::string& context) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_ != nullptr) return;  // the first error wins
    error_ = std::move(error);
    context_ = context;
  }
  cv_.notify_all();
}

bool Call::failed() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_ != nullptr;
}

void Call::job_done() { jobs_done_.finish(); }

void Call::wait_all() {
  std::exception_ptr error;
  std::string context;
  const auto n = static_cast<int64_t>(jobs.size());
  if (interruptible()) {
    // An interrupt fails the call like an error: the jobs stop at their next
    // operation and the call's effects are undone as after any failure.
    bool interrupted = false;
    while (!jobs_done_.wait_for(n, kInterruptPollPeriod)) {
      if (interrupted) continue;
      if (std::exception_ptr e = poll_interrupt()) {
        interrupted = true;
        fail(e, "in RoundPipe model '" + model.name + "': interrupted");
      }
    }
  } else {
    jobs_done_.wait_for(n);
  }
  // Also after an error: host memory a copy still reads or writes must not
  // be handed back (to the caller, the optimizer) before the copy is done.
  for (const auto& job_fences : fences) {
    for (const auto& fence : job_fences) {
      if (!fence) continue;
      try {
        fence->synchronize();
      } catch (...) {
        fail(std::current_exception(), "in RoundPipe model '" + model.name + "': waiting for a copy");
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    error = error_;
    context = context_;
  }
  if (error != nullptr) rethrow_with_context(error, context);
}

namespace {

template <typename E>
[[noreturn]] void rethrow_as(const E& e, const std::string& context) {
  throw E(std::string(e.what()) + "\n" + context);
}

}  // namespace

void rethrow_with_context(std::exception_ptr error, const std::string& context) {
  try {
    std::rethrow_exception(error);
  } catch (c10::Error& e) {
    e.add_context(context);  // same object, same type
    throw;
  } catch (std::exception& e) {
    if (auto* contextual = dynamic_cast<ContextualError*>(&e)) {
      contextual->add_context(context);
      throw;
    }
    // Standard exceptions cannot take context in place: rebuild the common
    // ones with the context appended; rethrow anything else unchanged.
    const std::type_info& type = typeid(e);
    if (type == typeid(std::runtime_error)) rethrow_as(static_cast<const std::runtime_error&>(e), context);
    if (type == typeid(std::invalid_argument))
      rethrow_as(static_cast<const std::invalid_argument&>(e), context);
    if (type == typeid(std::out_of_range)) rethrow_as(static_cast<const std::out_of_range&>(e), context);
    if (type == typeid(std::logic_error)) rethrow_as(static_cast<const std::logic_error&>(e), context);
    if (type == typeid(std::domain_error)) rethrow_as(static_cast<const std::domain_error&>(e), context);
    if (type == typeid(std::range_error)) rethrow_as(static_cast<const std::range_error&>(e), context);
    if (type == typeid(std::overflow_error))
      rethrow_as(static_cast<const std::overflow_error&>(e), context);
    throw;
  }
}

}  // namespace roundpipe
