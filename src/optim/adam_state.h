// Adam's per-parameter states in the formats of AdamOptions::state_dtype:
// creation, checks with messages that name the parameter and the tensor, and
// conversion between formats. Shared by roundpipe::optim::Adam and the Python
// binding (roundpipe.optim.Adam keeps the same tensors in torch.optim's dict).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "optim/checks.h"
#include "optim/kernels/kernels.h"
#include "roundpipe/optim/adam.h"

namespace roundpipe {
namespace optim {
namespace detail {

// The format a parameter of `numel` elements gets under `dtype`: fp32 for
// kBlockwise8 below kMinBlockwise8Numel.
kernels::StateFormat adam_state_format(StateDtype dtype, int64_t numel);

// "float32", "bfloat16", "blockwise8".
const char* state_format_name(kernels::StateFormat format);

// The tensors of one state, as stored (see adam.h for the layout per format).
struct AdamStateTensors {
  at::Tensor exp_avg;
  at::Tensor exp_avg_sq;
  at::Tensor max_exp_avg_sq;     // may be undefined
  at::Tensor exp_avg_absmax;     // 8-bit only
  at::Tensor exp_avg_sq_absmax;  // 8-bit only
};

AdamStateTensors state_tensors_of(const AdamParamState& state);
void set_state_tensors(const AdamStateTensors& tensors, AdamParamState* state);

// Checks the tensors of a state of a parameter of `numel` elements and returns
// their format (read from exp_avg's dtype: float32, bfloat16 or uint8 codes).
// c10::TypeError for a wrong dtype, layout or device, c10::ValueError for a
// missing, non-contiguous or wrongly sized tensor; the message names the
// parameter and the tensor.
kernels::StateFormat check_adam_state(const ParamRef& ref, const AdamStateTensors& state,
                                      int64_t numel);

// Zero states in `format`, shaped like `param` (max_exp_avg_sq when amsgrad).
AdamStateTensors zero_adam_state(const at::Tensor& param, kernels::StateFormat format,
                                 bool amsgrad);

// A checked state in format `from`, in format `to`: new tensors unless
// from == to (then `state` itself). Widening is exact; narrowing rounds to
// nearest even (bf16) or quantizes as the update does (8-bit, which drops
// max_exp_avg_sq).
AdamStateTensors convert_adam_state(const AdamStateTensors& state, kernels::StateFormat from,
                                    kernels::StateFormat to);

// Points the state members of `buffers` at a checked state in `format`
// (max_exp_avg_sq when amsgrad).
void set_state_buffers(const AdamStateTensors& state, kernels::StateFormat format, bool amsgrad,
                       kernels::CompactAdamBuffers* buffers);

// Points the parameter members of `buffers` at a bf16 parameter and its
// gradient (bf16 or fp32), with the stochastic rounding seeded by the rule of
// adam.h: sr_seed = param_index (over all groups), sr_step = step (of this
// update, 1 for the first), sr_offset = 0. So runs, and resumed runs, repeat
// bitwise on any ISA and thread count, and parameters draw independently.
void set_bf16_param_buffers(const at::Tensor& param, const at::Tensor& grad, int64_t param_index,
                            int64_t step, kernels::CompactAdamBuffers* buffers);

}  // namespace detail
}  // namespace optim
}  // namespace roundpipe
