// A call's bookkeeping: values between jobs, the first error, the wait for
// every job and copy.
#include "engine/call.h"

#include "engine/host_store.h"
#include "util/interrupt.h"

#include <chrono>
#include <thread>

namespace roundpipe {

// ---- Call bookkeeping ----

namespace {

constexpr std::chrono::microseconds kTakeSpin{50};

}  // namespace

void Call::init_flow() {
  flow.assign(jobs.size() + 1, std::vector<Slot>(num_microbatch));
  prefetched.assign(jobs.size(), StageTensors());
  losses.assign(num_microbatch, c10::IValue());
  outputs.assign(num_microbatch, c10::IValue());
  grads.assign(jobs.size(), {});
  buffers.assign(jobs.size(), {});
  fences.assign(jobs.size(), {});
  records.assign(jobs.size(), JobRecord());
  std::lock_guard<std::mutex> lock(mu_);
  uploaded_.assign(jobs.size(), 0);
  upload_fences_.assign(jobs.size(), nullptr);
}

void Call::find_readers() {
  const HostStore& store = *model.store;
  readers.assign(model.layers->size(), {});
  const auto add = [&](int64_t layer, int64_t job) {
    if (readers[layer].empty() || readers[layer].back() != job) readers[layer].push_back(job);
  };
  for (size_t j = 0; j < jobs.size(); ++j) {
    const LayerRange r = jobs[j].layers;
    for (int64_t l = r.begin; l < r.end; ++l) {
      add(l, static_cast<int64_t>(j));
      for (int64_t id : store.layer(l).param_ids) add(store.params()[id].owner, static_cast<int64_t>(j));
    }
  }
}

void Call::stage_uploaded(int64_t job, FencePtr fence) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    uploaded_.at(job) = 1;
    upload_fences_.at(job) = std::move(fence);
  }
  host_cv_.notify_all();
}

void Call::wait_read(int64_t layer) {
  if (readers.empty()) return;
  for (int64_t j : readers.at(layer)) {
    FencePtr fence;
    {
      std::unique_lock<std::mutex> lock(mu_);
      host_cv_.wait(lock, [&] { return uploaded_[j] || finished_jobs_ == static_cast<int64_t>(jobs.size()); });
      if (!uploaded_[j]) continue;  // never uploaded: the call failed first
      fence = upload_fences_[j];
    }
    if (!fence) continue;
    try {
      fence->synchronize();
    } catch (...) {
      // The copy failed (the call fails with it).
      wait_until_no_copy_runs();
      return;
    }
  }
}

void Call::wait_until_no_copy_runs() {
  jobs_done_.wait_for(static_cast<int64_t>(jobs.size()));
  for (const auto& job_fences : fences) {
    for (const auto& f : job_fences) {
      try {
        if (f) f->synchronize();
      } catch (...) {
      }
    }
  }
}

void Call::loss_handed(FencePtr fence) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    loss_fences_.push_back(std::move(fence));
  }
  host_cv_.notify_all();
}

bool Call::wait_losses() {
  const auto all = [&] {
    return static_cast<int64_t>(loss_fences_.size()) == num_microbatch || error_ != nullptr ||
           finished_jobs_ == static_cast<int64_t>(jobs.size());
  };
  std::vector<FencePtr> handed;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!interruptible()) {
      host_cv_.wait(lock, all);
    } else {
      while (!host_cv_.wait_for(lock, kInterruptPollPeriod, all)) {
        lock.unlock();  // the poll may take the GIL: never under this lock
        if (std::exception_ptr e = poll_interrupt()) fail(e, "in RoundPipe model '" + model.name + "': interrupted");
        lock.lock();
      }
    }
    if (error_ != nullptr || static_cast<int64_t>(loss_fences_.size()) != num_microbatch) return false;
    handed = loss_fences_;
  }
  for (const FencePtr& fence : handed) {
    if (!fence) continue;
    try {
      fence->synchronize();
    } catch (...) {
      fail(std::current_exception(), "in RoundPipe model '" + model.name + "': waiting for a loss");
      return false;
    }
  }
  return true;
}

Slot Call::wait(const Slot& slot) {
  std::unique_lock<std::mutex> lock(mu_);
  slots_cv_.wait(lock, [&] { return slot.ready || error_ != nullptr; });
  if (error_ != nullptr) throw Cancelled{};
  return slot;
}

Slot Call::take(Slot& slot) {
  std::unique_lock<std::mutex> lock(mu_);
  // The producer is usually a few microseconds away: yielding for a short
  // while before sleeping saves the wake-up of a sleeping thread (tens of
  // microseconds on a virtual machine's idle CPU) on the pipeline's path.
  const auto spin_until = std::chrono::steady_clock::now() + kTakeSpin;
  while (!slot.ready && error_ == nullptr && std::chrono::steady_clock::now() < spin_until) {
    lock.unlock();
    std::this_thread::yield();
    lock.lock();
  }
  slots_cv_.wait(lock, [&] { return slot.ready || error_ != nullptr; });
  if (error_ != nullptr) throw Cancelled{};
  // The job is the value's only reader: the slot lets it go, so a device's
  // memory or a page-locked host block goes when the job is done with it
  // rather than with the call.
  Slot out = std::move(slot);
  slot.value = c10::IValue();
  slot.fence = nullptr;
  slot.ready = true;
  return out;
}

void Call::publish(Slot& slot, Slot value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    slot = std::move(value);
    slot.ready = true;
  }
  slots_cv_.notify_all();
}

void Call::fail(std::exception_ptr error, const std::string& context) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_ != nullptr) return;  // the first error wins
    error_ = std::move(error);
    context_ = context;
  }
  if (buffer_out) buffer_out->fail();
  slots_cv_.notify_all();
  host_cv_.notify_all();
}

bool Call::failed() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_ != nullptr;
}

void Call::job_done() {
  {
    std::lock_guard<std::mutex> lock(mu_);  // notified under the lock: a waiter may free the call next
    // Host waiters wait for this only when it is the last job.
    if (++finished_jobs_ == static_cast<int64_t>(jobs.size())) host_cv_.notify_all();
  }
  jobs_done_.finish();
}

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

CallGradients Call::take_gradients() {
  CallGradients out{record ? record->call_id : 0, std::move(grads)};
  grads.clear();
  return out;
}

}  // namespace roundpipe
