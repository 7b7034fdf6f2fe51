// A directory of the test process's own under gtest's TempDir(), created on
// first use and removed with its contents when that process exits (not when
// a forked child does), so repeated runs leave nothing behind.
#pragma once

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace roundpipe {
namespace testing {

namespace scratch_detail {
inline const pid_t owner = ::getpid();
inline std::vector<std::string>& created() {
  static auto* dirs = new std::vector<std::string>();  // never destroyed: read at exit
  return *dirs;
}
inline void remove_created() {
  if (::getpid() != owner) return;
  for (const std::string& d : created()) {
    std::error_code ec;
    std::filesystem::remove_all(d, ec);
  }
}
}  // namespace scratch_detail

// `prefix` + the process id, under TempDir(); the same path on every call.
inline std::string scratch_dir(const std::string& prefix) {
  const std::string dir = ::testing::TempDir() + prefix + std::to_string(scratch_detail::owner);
  if (::mkdir(dir.c_str(), 0755) == 0) {
    if (scratch_detail::created().empty()) std::atexit(scratch_detail::remove_created);
    scratch_detail::created().push_back(dir);
  }
  return dir;
}

}  // namespace testing
}  // namespace roundpipe
