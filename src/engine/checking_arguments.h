// Errors of a call's argument checks name the model and the call, as the
// errors of the call's jobs do.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
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

// RunConfig::num_microbatch, wherever a config is given (the model's
// defaults, a call's).
inline void check_num_microbatch(int64_t n) {
  TORCH_CHECK_VALUE(n >= 1, "num_microbatch must be >= 1, got ", n);
}

}  // namespace roundpipe
