// Which thread may destroy a model's engine (docs/design/engine.md, "Who
// destroys what").
//
// Destroying an engine joins its optimizer thread after the tasks queued
// there, which may need other threads (a Python step_fn needs the GIL). So
// the engine is destroyed where its last owner lets go only on a thread that
// may wait for that:
//  - never on an engine thread (an optimizer thread or a device worker): it
//    could be the thread being joined, and it would stall other models' jobs;
//  - never on a thread that the embedding reports must not wait (the Python
//    binding: a thread holding the GIL).
// Anywhere else the destruction runs in place; there, it is handed to the
// process's reaper thread, which runs it next, in order.
//
// Thread-safety: thread-safe.
#pragma once

#include <functional>

namespace roundpipe {

// Runs `destroy` now if this thread may wait for engine threads, else queues
// it on the reaper thread. `destroy` must not throw.
void destroy_where_allowed(std::function<void()> destroy);

// The embedding's test for "this thread must not wait for engine threads"
// (null: none). Set once, before models exist.
void set_wait_forbidden_check(bool (*check)());

// Waits until every destruction handed to the reaper has run, including those
// handed on while waiting (for an orderly exit; also runs at process exit).
void wait_for_pending_destructions();

// The destructions handed to the reaper that have not finished yet.
int unfinished_destructions();

}  // namespace roundpipe
