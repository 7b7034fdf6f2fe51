#include "engine/optimizer_thread.h"

#include <atomic>
#include <exception>
#include <future>
#include <mutex>

namespace roundpipe {
namespace {

thread_local bool is_optimizer_thread = false;
thread_local int64_t step_task = 0;
std::atomic<int64_t> last_step_task{0};

// The model that most recently issued a step. Weak: the registry must not
// keep a model alive.
std::mutex registry_mu;
std::weak_ptr<const void> last_stepping_model;                           // guarded by registry_mu
std::function<void(std::function<void()>)> post_to_last_stepping_model;  // guarded by registry_mu

}  // namespace

namespace detail {

void mark_optimizer_thread() { is_optimizer_thread = true; }

void note_stepping_model(std::weak_ptr<const void> model,
                         std::function<void(std::function<void()>)> post) {
  std::lock_guard<std::mutex> lock(registry_mu);
  last_stepping_model = std::move(model);
  post_to_last_stepping_model = std::move(post);
}

void begin_step_task() { step_task = ++last_step_task; }

}  // namespace detail

bool on_optimizer_thread() { return is_optimizer_thread; }

int64_t current_step_task() { return step_task; }

void run_on_optimizer_thread(const std::function<void()>& fn) {
  if (is_optimizer_thread) {
    fn();
    return;
  }
  std::shared_ptr<const void> model;
  std::function<void(std::function<void()>)> post;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    model = last_stepping_model.lock();
    post = post_to_last_stepping_model;
  }
  if (!model) {
    fn();
    return;
  }
  std::promise<void> done;
  std::future<void> result = done.get_future();
  post([&fn, &done] {
    try {
      fn();
      done.set_value();
    } catch (...) {
      done.set_exception(std::current_exception());
    }
  });
  // Not held while waiting: if this was the last owner, the model's optimizer
  // thread runs the task above before it ends, so the wait still returns.
  model.reset();
  result.get();
}

}  // namespace roundpipe
