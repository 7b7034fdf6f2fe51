#include "util/interrupt.h"

#include <utility>

namespace roundpipe {
namespace {

thread_local InterruptPoll t_poll;

}  // namespace

InterruptScope::InterruptScope(InterruptPoll poll) : previous_(std::exchange(t_poll, std::move(poll))) {}

InterruptScope::~InterruptScope() { t_poll = std::move(previous_); }

std::exception_ptr poll_interrupt() { return t_poll ? t_poll() : nullptr; }

bool interruptible() { return static_cast<bool>(t_poll); }

}  // namespace roundpipe
