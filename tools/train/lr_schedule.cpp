#include "lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace roundpipe {
namespace train {

double LrSchedule::at(int64_t step) const {
  if (warmup_steps > 0 && step <= warmup_steps) {
    return peak_lr * static_cast<double>(std::max<int64_t>(step, 0)) / warmup_steps;
  }
  const int64_t decay_steps = total_steps - warmup_steps;
  if (decay_steps <= 0 || step >= total_steps) return decay_steps <= 0 ? peak_lr : min_lr;
  const double p = static_cast<double>(step - warmup_steps) / decay_steps;
  return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + std::cos(M_PI * p));
}

}  // namespace train
}  // namespace roundpipe
