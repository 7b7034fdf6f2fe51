// Reaching the optimizer thread from outside a step_fn: code that must run
// where the optimizer state lives (GradScaler's unscale_/step called on the
// main thread) is queued behind the steps already issued.
//
// Thread-safety: all functions are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

namespace roundpipe {

// True on the optimizer thread of any RoundPipe model.
bool on_optimizer_thread();

// Runs `fn` on the optimizer thread of the model that most recently issued a
// step, after the tasks already queued there (FIFO), and waits for it; an
// exception from `fn` propagates to the caller. Runs `fn` inline when called
// on an optimizer thread, or when no model has issued a step yet or that
// model is gone. A model destroyed meanwhile still runs `fn` (its optimizer
// thread drains its queue before it ends).
void run_on_optimizer_thread(const std::function<void()>& fn);

// On an optimizer thread: a process-wide unique id (>= 1) of the step task
// it runs now or ran last, so that code can tell whether two calls belong to
// the same step_fn. 0 elsewhere.
int64_t current_step_task();

namespace detail {
// Called by the optimizer side: the thread-local mark set on an optimizer
// thread at its start, the model issuing a step, and the start of a step task.
void mark_optimizer_thread();
// `model` (kept weakly) is the one that issued a step; `post` queues a task
// on its optimizer thread and is called only while `model` is held.
void note_stepping_model(std::weak_ptr<const void> model,
                         std::function<void(std::function<void()>)> post);
void begin_step_task();
}  // namespace detail

}  // namespace roundpipe
