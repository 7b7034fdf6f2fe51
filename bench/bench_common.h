// Shared helpers for the benchmarks: machine description, medians, and the
// alternating blocks every comparison with a baseline is timed in
// (block_timing.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "block_timing.h"

namespace roundpipe {
namespace bench {

inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

inline std::string machine_line() {
  return "machine: " + std::to_string(std::thread::hardware_concurrency()) + " cores, " + cpu_model() +
         ", intra-op threads " + std::to_string(at::get_num_threads());
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
double seconds(F&& f) {
  auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace bench
}  // namespace roundpipe
