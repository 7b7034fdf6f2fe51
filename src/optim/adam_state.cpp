#include "optim/adam_state.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <string>

namespace roundpipe {
namespace optim {
namespace detail {
namespace {

using kernels::StateFormat;

at::ScalarType dtype_of(StateFormat format) {
  switch (format) {
    case StateFormat::kFp32:
      return at::kFloat;
    case StateFormat::kBFloat16:
      return at::kBFloat16;
    case StateFormat::kBlockwise8:
      return at::kByte;
  }
  return at::kFloat;
}

void check_tensor(const ParamRef& ref, const char* what, const at::Tensor& t, at::ScalarType dtype,
                  int64_t numel, const char* why) {
  TORCH_CHECK_VALUE(t.defined(), ref, ": its state '", what, "' is missing (", why, ")");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, ref, ": its state '", what,
                   "' must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK_TYPE(t.device().is_cpu(), ref, ": its state '", what, "' must be on the CPU, got ",
                   t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, ref, ": its state '", what, "' must be ", dtype, " (",
                   why, "), got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), ref, ": its state '", what, "' must be contiguous (sizes ",
                    t.sizes(), ", strides ", t.strides(), ")");
  TORCH_CHECK_VALUE(t.numel() == numel, ref, ": its state '", what, "' has ", t.numel(),
                    " elements (sizes ", t.sizes(), "), expected ", numel, " (", why, ")");
}

at::Tensor widen(const at::Tensor& t, const at::Tensor& absmax, StateFormat from, bool is_signed) {
  if (from == StateFormat::kBlockwise8) {
    at::Tensor out = at::empty(t.sizes(), t.options().dtype(at::kFloat));
    kernels::blockwise8_dequantize(t.data_ptr<uint8_t>(), absmax.data_ptr<float>(),
                                   out.data_ptr<float>(), t.numel(), is_signed);
    return out;
  }
  return t.to(at::kFloat);  // exact from bf16; `t` itself from fp32
}

// `fp32` narrowed to `to`; *absmax receives the block scales of 8-bit.
at::Tensor narrow(const at::Tensor& fp32, StateFormat to, bool is_signed, at::Tensor* absmax) {
  switch (to) {
    case StateFormat::kFp32:
      return fp32.clone();
    case StateFormat::kBFloat16:
      return fp32.to(at::kBFloat16);  // round to nearest even, as the update stores
    case StateFormat::kBlockwise8: {
      const int64_t n = fp32.numel();
      at::Tensor codes = at::empty(fp32.sizes(), fp32.options().dtype(at::kByte));
      *absmax = at::empty({kernels::blockwise8_num_blocks(n)}, fp32.options());
      kernels::blockwise8_quantize(fp32.data_ptr<float>(), codes.data_ptr<uint8_t>(),
                                   absmax->data_ptr<float>(), n, is_signed);
      return codes;
    }
  }
  return {};
}

}  // namespace

StateFormat adam_state_format(StateDtype dtype, int64_t numel) {
  switch (dtype) {
    case StateDtype::kFloat32:
      return StateFormat::kFp32;
    case StateDtype::kBFloat16:
      return StateFormat::kBFloat16;
    case StateDtype::kBlockwise8:
      return numel < kMinBlockwise8Numel ? StateFormat::kFp32 : StateFormat::kBlockwise8;
  }
  return StateFormat::kFp32;
}

const char* state_format_name(StateFormat format) {
  switch (format) {
    case StateFormat::kFp32:
      return "float32";
    case StateFormat::kBFloat16:
      return "bfloat16";
    case StateFormat::kBlockwise8:
      return "blockwise8";
  }
  return "unknown";
}

AdamStateTensors state_tensors_of(const AdamParamState& state) {
  return {state.exp_avg(), state.exp_avg_sq(), state.max_exp_avg_sq(), state.exp_avg_absmax(),
          state.exp_avg_sq_absmax()};
}

void set_state_tensors(const AdamStateTensors& tensors, AdamParamState* state) {
  state->exp_avg(tensors.exp_avg);
  state->exp_avg_sq(tensors.exp_avg_sq);
  state->max_exp_avg_sq(tensors.max_exp_avg_sq);
  state->exp_avg_absmax(tensors.exp_avg_absmax);
  state->exp_avg_sq_absmax(tensors.exp_avg_sq_absmax);
}

StateFormat check_adam_state(const ParamRef& ref, const AdamStateTensors& s, int64_t numel) {
  TORCH_CHECK_VALUE(s.exp_avg.defined(), ref, ": its state 'exp_avg' is missing");
  StateFormat format = StateFormat::kFp32;
  switch (s.exp_avg.scalar_type()) {
    case at::kFloat:
      format = StateFormat::kFp32;
      break;
    case at::kBFloat16:
      format = StateFormat::kBFloat16;
      break;
    case at::kByte:
      format = StateFormat::kBlockwise8;
      break;
    default:
      TORCH_CHECK_TYPE(false, ref, ": its state 'exp_avg' has dtype ", s.exp_avg.scalar_type(),
                       "; Adam states are float32, bfloat16, or uint8 codes with "
                       "'exp_avg_absmax' (8-bit blockwise)");
  }
  const std::string why = std::string("its 'exp_avg' is ") + state_format_name(format) +
                          (format == StateFormat::kBlockwise8 ? " codes" : "") +
                          ", the parameter has " + std::to_string(numel) + " elements";
  const at::ScalarType dtype = dtype_of(format);
  check_tensor(ref, "exp_avg", s.exp_avg, dtype, numel, why.c_str());
  check_tensor(ref, "exp_avg_sq", s.exp_avg_sq, dtype, numel, why.c_str());
  if (format == StateFormat::kBlockwise8) {
    TORCH_CHECK_VALUE(!s.max_exp_avg_sq.defined(), ref,
                      ": its state has 'max_exp_avg_sq' beside 8-bit 'exp_avg' codes; 8-bit "
                      "states have no amsgrad (use fp32 or bf16 states for amsgrad)");
    const int64_t blocks = kernels::blockwise8_num_blocks(numel);
    const std::string block_why =
        why + ", one absmax per block of " + std::to_string(kernels::kBlockwise8BlockSize);
    check_tensor(ref, "exp_avg_absmax", s.exp_avg_absmax, at::kFloat, blocks, block_why.c_str());
    check_tensor(ref, "exp_avg_sq_absmax", s.exp_avg_sq_absmax, at::kFloat, blocks,
                 block_why.c_str());
  } else if (s.max_exp_avg_sq.defined()) {
    check_tensor(ref, "max_exp_avg_sq", s.max_exp_avg_sq, dtype, numel, why.c_str());
  }
  return format;
}

namespace {

// The code of 0 in a blockwise-8 map (what quantizing a zero block gives).
int64_t zero_code(bool is_signed) {
  const float* map = kernels::blockwise8_map(is_signed);
  int64_t code = 0;
  while (map[code] != 0.0f) ++code;
  return code;
}

}  // namespace

// Zero states made in their own format: no fp32 array of the parameter's
// size to narrow (the largest, an embedding, would add 4 bytes per element
// to the first step's peak).
AdamStateTensors zero_adam_state(const at::Tensor& param, StateFormat format, bool amsgrad) {
  AdamStateTensors s;
  const at::TensorOptions options = param.options().dtype(dtype_of(format));
  if (format == StateFormat::kBlockwise8) {
    const int64_t blocks = kernels::blockwise8_num_blocks(param.numel());
    s.exp_avg = at::full(param.sizes(), zero_code(/*is_signed=*/true), options);
    s.exp_avg_sq = at::full(param.sizes(), zero_code(/*is_signed=*/false), options);
    s.exp_avg_absmax = at::zeros({blocks}, param.options().dtype(at::kFloat));
    s.exp_avg_sq_absmax = at::zeros({blocks}, param.options().dtype(at::kFloat));
    return s;
  }
  s.exp_avg = at::zeros(param.sizes(), options);
  s.exp_avg_sq = at::zeros(param.sizes(), options);
  if (amsgrad) s.max_exp_avg_sq = at::zeros(param.sizes(), options);
  return s;
}

AdamStateTensors convert_adam_state(const AdamStateTensors& s, StateFormat from, StateFormat to) {
  if (from == to) return s;
  AdamStateTensors out;
  out.exp_avg = narrow(widen(s.exp_avg, s.exp_avg_absmax, from, /*is_signed=*/true), to,
                       /*is_signed=*/true, &out.exp_avg_absmax);
  out.exp_avg_sq = narrow(widen(s.exp_avg_sq, s.exp_avg_sq_absmax, from, /*is_signed=*/false), to,
                          /*is_signed=*/false, &out.exp_avg_sq_absmax);
  if (s.max_exp_avg_sq.defined() && to != StateFormat::kBlockwise8) {
    out.max_exp_avg_sq = narrow(widen(s.max_exp_avg_sq, {}, from, false), to, false, nullptr);
  }
  return out;
}

void set_state_buffers(const AdamStateTensors& s, StateFormat format, bool amsgrad,
                       kernels::CompactAdamBuffers* b) {
  b->state_format = format;
  switch (format) {
    case StateFormat::kFp32:
      b->exp_avg.fp32 = s.exp_avg.data_ptr<float>();
      b->exp_avg_sq.fp32 = s.exp_avg_sq.data_ptr<float>();
      if (amsgrad) b->max_exp_avg_sq.fp32 = s.max_exp_avg_sq.data_ptr<float>();
      break;
    case StateFormat::kBFloat16:
      b->exp_avg.bf16 = static_cast<uint16_t*>(s.exp_avg.data_ptr());
      b->exp_avg_sq.bf16 = static_cast<uint16_t*>(s.exp_avg_sq.data_ptr());
      if (amsgrad) b->max_exp_avg_sq.bf16 = static_cast<uint16_t*>(s.max_exp_avg_sq.data_ptr());
      break;
    case StateFormat::kBlockwise8:
      b->exp_avg.codes = s.exp_avg.data_ptr<uint8_t>();
      b->exp_avg.absmax = s.exp_avg_absmax.data_ptr<float>();
      b->exp_avg_sq.codes = s.exp_avg_sq.data_ptr<uint8_t>();
      b->exp_avg_sq.absmax = s.exp_avg_sq_absmax.data_ptr<float>();
      break;
  }
}

void set_bf16_param_buffers(const at::Tensor& param, const at::Tensor& grad, int64_t param_index,
                            int64_t step, kernels::CompactAdamBuffers* b) {
  b->param_format = kernels::ParamFormat::kBFloat16Stochastic;
  b->param_bf16 = static_cast<uint16_t*>(param.data_ptr());
  if (grad.scalar_type() == at::kBFloat16) {
    b->grad_bf16 = static_cast<const uint16_t*>(grad.data_ptr());
  } else {
    b->grad = grad.data_ptr<float>();
  }
  b->sr_seed = static_cast<uint64_t>(param_index);
  b->sr_step = static_cast<uint64_t>(step);
  b->sr_offset = 0;
}

}  // namespace detail
}  // namespace optim
}  // namespace roundpipe
