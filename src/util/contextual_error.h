// Errors that gain context as they travel up: where a failure happened (the
// model, stage, layer, microbatch and device) is added to the exception
// itself, keeping its type, so a caller catches what was thrown.
//
// Thread-safety: a pure function; an exception is handled by one thread.
#pragma once

#include <exception>
#include <string>

namespace roundpipe {

// An exception that is not a c10::Error but takes the engine's context in
// place, so it keeps its identity (a language binding's errors, e.g. a Python
// exception that must reach Python as its own class).
class ContextualError {
 public:
  virtual ~ContextualError() = default;
  virtual void add_context(const std::string& context) = 0;
};

// Rethrows `error` with `context` added, keeping the exception's type.
[[noreturn]] void rethrow_with_context(std::exception_ptr error, const std::string& context);

}  // namespace roundpipe
