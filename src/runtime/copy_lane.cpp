#include "runtime/copy_lane.h"

#include <c10/util/Exception.h>

#include <utility>

namespace roundpipe {

class CopyLane::LaneFence final : public Fence {
 public:
  LaneFence(std::shared_ptr<State> state, int64_t upto) : state_(std::move(state)), upto_(upto) {}
  bool query() const override {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->completed >= upto_ && !state_->error;
  }
  void synchronize() const override {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->done.wait(lock, [&] { return state_->completed >= upto_; });
    if (state_->error) {
      std::exception_ptr error = state_->error;
      lock.unlock();
      try {
        std::rethrow_exception(error);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "a copy on ", state_->name, " failed: ", e.what_without_backtrace());
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "a copy on ", state_->name, " failed: ", e.what());
      }
    }
  }

 private:
  std::shared_ptr<State> state_;
  int64_t upto_;
};

// Its time is set by the lane's thread when the lane reaches it; reading it
// waits for that.
class CopyLane::LaneMark final : public TimeMark {
 public:
  explicit LaneMark(std::shared_ptr<State> state) : TimeMark(0.0), state_(std::move(state)) {}
  void reach() {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      reach_locked();
    }
    state_->done.notify_all();
  }
  void reach_locked() { at_ms_ = host_now_ms(); }
  double host_ms() const override {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->done.wait(lock, [&] { return at_ms_ >= 0.0; });
    return at_ms_;
  }
  double ms_since(const TimeMark& earlier) const override { return host_ms() - earlier.host_ms(); }

 private:
  std::shared_ptr<State> state_;
  double at_ms_ = -1.0;  // guarded by state_->mu
};

CopyLane::CopyLane(std::string name, std::chrono::microseconds delay)
    : delay_us_(delay.count()), state_(std::make_shared<State>()) {
  state_->name = std::move(name);
  thread_ = std::thread([this] { loop(); });
}

CopyLane::~CopyLane() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stopping = true;
  }
  state_->work.notify_all();
  thread_.join();
}

void CopyLane::enqueue(std::chrono::steady_clock::time_point due, std::function<void()> run) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.push_back(Item{due, std::move(run)});
    ++state_->issued;
  }
  state_->work.notify_all();
}

bool CopyLane::run_now_if_idle(const FencePtr& after, const std::function<void()>& copy) {
  if (delay().count() > 0 || (after && !after->query())) return false;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->queue.empty() || state_->running) return false;
    state_->running = true;  // the lane's thread starts nothing issued meanwhile
    ++state_->issued;
  }
  std::exception_ptr error;
  try {
    copy();
  } catch (...) {
    error = std::current_exception();
  }
  finish(error);
  return true;
}

void CopyLane::finish(std::exception_ptr error) {
  bool queued;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (error && !state_->error) state_->error = error;
    state_->running = false;
    ++state_->completed;
    queued = !state_->queue.empty();
  }
  state_->done.notify_all();
  if (queued) state_->work.notify_all();  // issued while an inline copy ran
}

void CopyLane::issue(std::function<void()> copy) {
  if (run_now_if_idle(nullptr, copy)) return;
  enqueue(std::chrono::steady_clock::now() + delay(), std::move(copy));
}

void CopyLane::issue_after(FencePtr after, std::function<void()> copy) {
  if (!after) return issue(std::move(copy));
  if (run_now_if_idle(after, copy)) return;
  enqueue(std::chrono::steady_clock::now() + delay(), [after = std::move(after), copy = std::move(copy)] {
    after->synchronize();
    copy();
  });
}

FencePtr CopyLane::fence() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return std::make_shared<LaneFence>(state_, state_->issued);
}

MarkPtr CopyLane::mark() {
  auto mark = std::make_shared<LaneMark>(state_);
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->queue.empty() && !state_->running) {  // the lane is here now
      mark->reach_locked();
      return mark;
    }
  }
  // A mark waits for what was issued before it, not for the copy delay.
  enqueue(std::chrono::steady_clock::time_point::min(), [mark] { mark->reach(); });
  return mark;
}

void CopyLane::loop() {
  State& s = *state_;
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(s.mu);
      s.work.wait(lock, [&] { return (s.stopping || !s.queue.empty()) && !s.running; });
      if (s.queue.empty()) return;  // stopping, and everything issued has run
      item = std::move(s.queue.front());
      s.queue.pop_front();
      s.running = true;
    }
    std::this_thread::sleep_until(item.due);
    std::exception_ptr error;
    try {
      item.run();
    } catch (...) {
      error = std::current_exception();
    }
    // What the copy held (its source and destination) is released before
    // its fence completes.
    item.run = nullptr;
    finish(error);
  }
}

}  // namespace roundpipe
