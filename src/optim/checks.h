// Shared by the optimizers: state keys, parameter/gradient/state/copy checks
// with messages that name the parameter, and option (de)serialization helpers.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "optim/kernels/kernels.h"

namespace roundpipe {
namespace optim {
namespace detail {

// Optimizer::state() is keyed by the parameter's TensorImpl pointer.
using StateKey = void*;

// The key libtorch's own optimizers use for `param`.
StateKey state_key(const at::Tensor& param);

// A parameter's place, for messages: "Adam: parameter 3 (group 1, position 0)".
struct ParamRef {
  const char* optimizer;
  int64_t index;  // over all groups, in group order
  size_t group;
  size_t position;  // within the group
};
std::ostream& operator<<(std::ostream& out, const ParamRef& ref);

// Runs an optimizer's loss closure (with grad mode on, as libtorch does);
// an undefined tensor without one.
torch::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure);

// Total number of parameters over all groups.
size_t count_params(const std::vector<torch::optim::OptimizerParamGroup>& groups);

// The parameter dtypes an optimizer updates: Adam also takes bf16 parameters
// (updated with stochastic rounding), SGD float32 only.
enum class ParamDtypes { kFloat32, kFloat32OrBFloat16 };

// A parameter: defined, of an `accepted` dtype, strided, CPU, contiguous, not
// an inference tensor outside inference mode. c10::TypeError /
// c10::ValueError otherwise.
void check_param(const ParamRef& ref, const at::Tensor& param, ParamDtypes accepted);

// All parameters of all groups.
void check_params(const char* optimizer,
                  const std::vector<torch::optim::OptimizerParamGroup>& groups,
                  ParamDtypes accepted);

// `groups` after check_params, for a constructor's base-class initializer:
// libtorch's Optimizer dereferences its parameters (an undefined one would
// fail there with an unclear message), so they are checked before it runs.
std::vector<torch::optim::OptimizerParamGroup> checked_groups(
    const char* optimizer, std::vector<torch::optim::OptimizerParamGroup> groups,
    ParamDtypes accepted);

// A tensor read or written beside a parameter (`what`: "gradient", "state
// 'exp_avg'", ...): like check_param, and `numel` elements.
void check_companion(const ParamRef& ref, const char* what, const at::Tensor& t, int64_t numel);

// A parameter's gradient: like check_param, and the parameter's sizes;
// float32, or bfloat16 too for a bfloat16 parameter.
void check_grad(const ParamRef& ref, const at::Tensor& grad, const at::Tensor& param);

// A low-precision copy: contiguous CPU bfloat16/float16 of `numel` elements.
kernels::LowpKind check_lowp_copy(const ParamRef& ref, const at::Tensor& copy, int64_t numel);

// `lowp_copies` has one entry per parameter.
void check_lowp_count(const char* optimizer, size_t given, size_t expected);

// Where parameter `index`'s update also writes its low-precision copy: the
// copy's data as uint16_t* and its kind ({null, kNone} without copies or for
// an undefined entry). Records the coming write in the copy's version.
std::pair<uint16_t*, kernels::LowpKind> claim_lowp_target(const std::vector<at::Tensor>* copies,
                                                          size_t index);

// Records an in-place write made through a raw pointer, as an in-place op would.
void bump_version(const at::Tensor& t);

// Option I/O: write a value; read one that must be present; read one that may
// be absent (returns whether it was there).
void write_option(torch::serialize::OutputArchive& archive, const char* key, c10::IValue value);
c10::IValue read_option(torch::serialize::InputArchive& archive, const char* key);
bool try_read_option(torch::serialize::InputArchive& archive, const char* key, c10::IValue* value);

}  // namespace detail
}  // namespace optim
}  // namespace roundpipe
