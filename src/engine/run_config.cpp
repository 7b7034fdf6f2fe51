#include "roundpipe/run_config.h"

namespace roundpipe {

RunConfig RunConfig::merged_over(const RunConfig& base) const {
  RunConfig out = base;
  if (num_microbatch_) out.num_microbatch_ = num_microbatch_;
  if (recompute_grain_) out.recompute_grain_ = recompute_grain_;
  if (output_device_) out.output_device_ = output_device_;
  if (preserve_rng_state_) out.preserve_rng_state_ = preserve_rng_state_;
  if (requires_grad_) out.requires_grad_ = requires_grad_;
  if (split_input_) out.split_input_ = split_input_;
  if (split_label_) out.split_label_ = split_label_;
  if (merge_output_) out.merge_output_ = merge_output_;
  if (execute_plan_) out.execute_plan_ = execute_plan_;
  return out;
}

}  // namespace roundpipe
