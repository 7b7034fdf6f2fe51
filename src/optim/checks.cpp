#include "optim/checks.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <ostream>

namespace roundpipe {
namespace optim {
namespace detail {
namespace {

// The checks every tensor of an update shares; `bf16_accepted`: bfloat16 is
// accepted beside float32.
void check_float_cpu_dense(const ParamRef& ref, const char* what, const at::Tensor& t,
                           bool bf16_accepted = false) {
  TORCH_CHECK_VALUE(t.defined(), ref, ": ", what, " is an undefined tensor");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, ref, ": ", what,
                   " must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK_TYPE(t.device().is_cpu(), ref, ": ", what, " must be on the CPU, got ", t.device());
  if (bf16_accepted) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, ref, ": ",
                     what, " must be float32 or bfloat16, got ", t.scalar_type());
  } else {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, ref, ": ", what, " must be float32, got ",
                     t.scalar_type());
  }
  TORCH_CHECK_VALUE(t.is_contiguous(), ref, ": ", what, " must be contiguous (sizes ", t.sizes(),
                    ", strides ", t.strides(), ")");
}

}  // namespace

StateKey state_key(const at::Tensor& param) { return param.unsafeGetTensorImpl(); }

std::ostream& operator<<(std::ostream& out, const ParamRef& ref) {
  return out << "roundpipe::optim::" << ref.optimizer << ": parameter " << ref.index << " (group "
             << ref.group << ", position " << ref.position << ")";
}

torch::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (closure == nullptr) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

size_t count_params(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  size_t n = 0;
  for (const auto& group : groups) n += group.params().size();
  return n;
}

void check_param(const ParamRef& ref, const at::Tensor& param, ParamDtypes accepted) {
  check_float_cpu_dense(ref, "the parameter", param, accepted == ParamDtypes::kFloat32OrBFloat16);
  TORCH_CHECK_VALUE(!param.is_inference() || c10::InferenceMode::is_enabled(), ref,
                    ": the parameter is an inference tensor; it can only be updated in place "
                    "inside InferenceMode");
}

void check_params(const char* optimizer,
                  const std::vector<torch::optim::OptimizerParamGroup>& groups,
                  ParamDtypes accepted) {
  int64_t index = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      check_param({optimizer, index++, g, i}, params[i], accepted);
    }
  }
}

std::vector<torch::optim::OptimizerParamGroup> checked_groups(
    const char* optimizer, std::vector<torch::optim::OptimizerParamGroup> groups,
    ParamDtypes accepted) {
  check_params(optimizer, groups, accepted);
  return groups;
}

void check_companion(const ParamRef& ref, const char* what, const at::Tensor& t, int64_t numel) {
  check_float_cpu_dense(ref, what, t);
  TORCH_CHECK_VALUE(t.numel() == numel, ref, ": ", what, " has ", t.numel(), " elements (sizes ",
                    t.sizes(), "), the parameter ", numel);
}

void check_grad(const ParamRef& ref, const at::Tensor& grad, const at::Tensor& param) {
  // A bf16 parameter is updated from a bf16 or an fp32 gradient alike (the
  // kernel widens bf16 exactly); an fp32 one needs fp32.
  check_float_cpu_dense(ref, "its gradient", grad, param.scalar_type() == at::kBFloat16);
  TORCH_CHECK_VALUE(grad.sizes() == param.sizes(), ref, ": its gradient has sizes ", grad.sizes(),
                    ", the parameter ", param.sizes());
}

kernels::LowpKind check_lowp_copy(const ParamRef& ref, const at::Tensor& copy, int64_t numel) {
  if (!copy.defined()) return kernels::LowpKind::kNone;
  TORCH_CHECK_TYPE(copy.layout() == at::kStrided && copy.device().is_cpu(), ref,
                   ": the low-precision copy must be a dense CPU tensor, got layout ",
                   copy.layout(), " on ", copy.device());
  TORCH_CHECK_TYPE(copy.scalar_type() == at::kBFloat16 || copy.scalar_type() == at::kHalf, ref,
                   ": the low-precision copy must be bfloat16 or float16, got ",
                   copy.scalar_type());
  TORCH_CHECK_VALUE(copy.is_contiguous(), ref, ": the low-precision copy must be contiguous");
  TORCH_CHECK_VALUE(copy.numel() == numel, ref, ": the low-precision copy has ", copy.numel(),
                    " elements, the parameter ", numel);
  return copy.scalar_type() == at::kBFloat16 ? kernels::LowpKind::kBFloat16
                                             : kernels::LowpKind::kFloat16;
}

void check_lowp_count(const char* optimizer, size_t given, size_t expected) {
  TORCH_CHECK_VALUE(given == expected, "roundpipe::optim::", optimizer,
                    "::step_with_lowp_copy: got ", given, " low-precision copies for ", expected,
                    " parameters (one entry per parameter, undefined for none)");
}

std::pair<uint16_t*, kernels::LowpKind> claim_lowp_target(const std::vector<at::Tensor>* copies,
                                                          size_t index) {
  if (copies == nullptr || !(*copies)[index].defined()) return {nullptr, kernels::LowpKind::kNone};
  const at::Tensor& copy = (*copies)[index];
  bump_version(copy);
  const auto kind = copy.scalar_type() == at::kBFloat16 ? kernels::LowpKind::kBFloat16
                                                        : kernels::LowpKind::kFloat16;
  return {static_cast<uint16_t*>(copy.data_ptr()), kind};
}

void bump_version(const at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }

void write_option(torch::serialize::OutputArchive& archive, const char* key, c10::IValue value) {
  archive.write(key, value);
}

c10::IValue read_option(torch::serialize::InputArchive& archive, const char* key) {
  c10::IValue value;
  TORCH_CHECK_VALUE(archive.try_read(key, value), "optimizer archive: option '", key,
                    "' is missing");
  return value;
}

bool try_read_option(torch::serialize::InputArchive& archive, const char* key, c10::IValue* value) {
  return archive.try_read(key, *value);
}

}  // namespace detail
}  // namespace optim
}  // namespace roundpipe
