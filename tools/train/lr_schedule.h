// The learning-rate schedule of roundpipe-train: linear warm-up from 0 to the
// peak rate, then cosine decay to the minimum rate at the last step.
//
//   step s (1-based) <= warmup:  lr = peak * s / warmup
//   afterwards:                  lr = min + (peak - min) * (1 + cos(pi * p)) / 2,
//                                p = (s - warmup) / (total - warmup)
//
// A value type; thread-compatible.
#pragma once

#include <cstdint>

namespace roundpipe {
namespace train {

struct LrSchedule {
  double peak_lr = 1e-3;
  double min_lr = 0.0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;

  // The rate of step `step` (1-based; steps past total_steps get min_lr).
  double at(int64_t step) const;
};

}  // namespace train
}  // namespace roundpipe
