// Who may call a model, and when (docs/python.md, "Threads"):
//  - calls from several threads are serialized: the model runs one user call
//    at a time and the others wait their turn (interruptibly, in no
//    particular order);
//  - a call made from inside user code the engine runs for a model (a
//    step_fn on an optimizer thread; a loss_fn or a layer on a device
//    thread) is a c10::Error at once, naming the call and that code: it
//    would wait for the very thread it runs on;
//  - one thread may nest calls (the public functions call one another, and
//    a split or merge function runs on the caller's thread).
//
// Thread-safety: ModelUseLock is thread-safe; a UserCodeScope belongs to
// the thread that made it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

namespace roundpipe {

// Marks this thread as running user code for model `model` (a name, for
// messages) while it lives: `what` says what runs ("the step_fn", "the
// loss_fn", "layer" with its index `layer`). Scopes nest.
class UserCodeScope {
 public:
  UserCodeScope(const std::string& model, const char* what, int64_t layer = -1);
  ~UserCodeScope();
  UserCodeScope(const UserCodeScope&) = delete;
  UserCodeScope& operator=(const UserCodeScope&) = delete;

  // This thread's innermost scope, or null.
  static const UserCodeScope* current();
  // "the loss_fn of model 'm'", "layer 3 of model 'm'"
  std::string describe() const;

 private:
  const std::string& model_;
  const char* what_;
  int64_t layer_;
  const UserCodeScope* outer_;
};

class ModelUseLock {
 public:
  explicit ModelUseLock(std::string model) : model_(std::move(model)) {}

  // Held by one public call (`call`: its name, for messages) while it lives.
  class Scope {
   public:
    Scope(ModelUseLock& lock, const char* call) : lock_(lock) { lock_.enter(call); }
    ~Scope() { lock_.leave(); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    ModelUseLock& lock_;
  };

 private:
  void enter(const char* call);
  void leave();

  const std::string model_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread::id owner_;  // guarded by mu_; default: none
  int64_t depth_ = 0;      // guarded by mu_
};

}  // namespace roundpipe
