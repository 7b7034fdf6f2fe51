// Errors of a call's argument checks name the model and the call, as the
// errors of the call's jobs do.
#pragma once

#include <c10/util/Exception.h>

#include <string>

namespace roundpipe {

// Runs `f`, which checks and prepares a call's arguments (run config, plan,
// microbatch count, splits); its errors name the model and the call, as the
// errors of the call's jobs do.
template <typename F>
auto checking_arguments(const std::string& model, const char* call, F&& f) {
  try {
    return f();
  } catch (c10::Error& e) {
    e.add_context("in RoundPipe model '" + model + "': " + call);  // same object, same type
    throw;
  }
}

}  // namespace roundpipe
