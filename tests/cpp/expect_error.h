// Checking the errors that bad input gets: the message of the exception of an
// expected type, and the fragments it must contain.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace roundpipe {
namespace testing {

// The message of the exception of type E that f throws ("" if none).
template <typename E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what_without_backtrace();
  }
  return "";
}

inline void expect_message(const std::string& msg, const std::vector<std::string>& fragments) {
  ASSERT_FALSE(msg.empty()) << "no error of the expected type";
  for (const auto& f : fragments) {
    EXPECT_NE(msg.find(f), std::string::npos) << "missing \"" << f << "\" in: " << msg;
  }
}

}  // namespace testing
}  // namespace roundpipe
