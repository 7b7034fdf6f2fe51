// Throughput of two or more sides compared in alternating blocks of
// iterations (docs/guide.md: a ratio measured side by side, median of at
// least 5 repetitions after a warm-up).
//
// Why blocks: a roundpipe call returns at its losses while its backward
// stages run on (iterations overlap). Timing one call and then one baseline
// step charges the baseline with the call's unfinished work, which runs on
// the same cores or device, and credits it to roundpipe. A block here is
// `steps` iterations of one side followed by that side's `finish` (for
// roundpipe `synchronize()`), all inside the timed interval, so every block
// starts with nothing of any side in flight and ends with all of its own work
// done. Blocks of the sides alternate, the order rotating every round so that
// no side always follows the same one.
//
// Only the standard library: the harness test (tests/cpp/test_block_timing.cpp)
// includes it without the engine.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace roundpipe {
namespace bench {

struct BlockSide {
  std::string name;
  std::function<void()> step;    // one iteration
  std::function<void()> finish;  // waits for the side's outstanding work; may be empty
};

struct BlockOptions {
  int warmup_rounds = 1;    // untimed rounds (every side one block each) first
  int rounds = 5;           // timed blocks per side
  int steps_per_block = 2;  // iterations per block
};

struct BlockTimes {
  std::string name;
  std::vector<double> seconds_per_step;  // one entry per timed block
  double median = 0;                     // seconds per iteration
  double min = 0, max = 0;
};

// Seconds per iteration of one block: `steps` calls of `step`, then `finish`.
inline double time_block(const BlockSide& side, int steps) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) side.step();
  if (side.finish) side.finish();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
}

inline std::vector<BlockTimes> alternate_blocks(const std::vector<BlockSide>& sides,
                                                const BlockOptions& opt) {
  const size_t n = sides.size();
  std::vector<BlockTimes> out(n);
  for (size_t i = 0; i < n; ++i) out[i].name = sides[i].name;
  for (int round = 0; round < opt.warmup_rounds + opt.rounds; ++round) {
    for (size_t k = 0; k < n; ++k) {
      const size_t i = (k + static_cast<size_t>(round)) % n;
      const double t = time_block(sides[i], opt.steps_per_block);
      if (round >= opt.warmup_rounds) out[i].seconds_per_step.push_back(t);
    }
  }
  for (BlockTimes& b : out) {
    std::vector<double> v = b.seconds_per_step;
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    b.median = v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
    b.min = v.front();
    b.max = v.back();
  }
  return out;
}

// The protocol, for the benchmark's output.
inline std::string describe(const BlockOptions& opt) {
  return "timing: blocks of " + std::to_string(opt.steps_per_block) +
         " iterations, each ending when its side's work is done (roundpipe: synchronize()), "
         "sides alternated, median of " +
         std::to_string(opt.rounds) + " blocks after " + std::to_string(opt.warmup_rounds) +
         " warm-up round(s)";
}

}  // namespace bench
}  // namespace roundpipe
