// The update kernels of roundpipe.optim.Adam/AdamW/SGD (python/roundpipe/optim.py
// keeps torch.optim's state layout; these run one step over a parameter group).
#include <ATen/Functions.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "optim/adam_state.h"
#include "optim/checks.h"
#include "optim/kernels/kernels.h"
#include "python/python_common.h"

namespace roundpipe {
namespace python {
namespace {

using optim::detail::ParamRef;
namespace kernels = optim::kernels;

using optim::detail::ParamDtypes;

// A parameter's place (index over all groups, group, position), as Python
// passes it for messages and seeds.
using Place = std::tuple<int64_t, int64_t, int64_t>;

// Checks the parameters and gradients; they are named by `places` when given,
// else by their position in the lists.
std::vector<ParamRef> check_group(const char* name, const std::vector<at::Tensor>& params,
                                  const std::vector<at::Tensor>& grads, ParamDtypes accepted,
                                  const std::vector<Place>* places = nullptr) {
  TORCH_CHECK_VALUE(params.size() == grads.size(), name, ": ", params.size(), " parameters but ", grads.size(),
                    " gradients");
  TORCH_CHECK_VALUE(places == nullptr || places->size() == params.size(), name, ": ", params.size(),
                    " parameters but ", places->size(), " places");
  std::vector<ParamRef> refs;
  for (size_t i = 0; i < params.size(); ++i) {
    ParamRef ref{name, static_cast<int64_t>(i), 0, i};
    if (places != nullptr) {
      const auto& [index, group, position] = (*places)[i];
      ref = ParamRef{name, index, static_cast<size_t>(group), static_cast<size_t>(position)};
    }
    optim::detail::check_param(ref, params[i], accepted);
    optim::detail::check_grad(ref, grads[i], params[i]);
    refs.push_back(ref);
  }
  return refs;
}

// One Adam/AdamW step over the parameters of a group that have gradients.
// `steps`: each parameter's step count after this update.
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<int64_t>& steps, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool amsgrad, bool maximize,
               bool decoupled) {
  const char* name = decoupled ? "AdamW" : "Adam";
  auto refs = check_group(name, params, grads, ParamDtypes::kFloat32);
  TORCH_CHECK_VALUE(exp_avgs.size() == params.size() && exp_avg_sqs.size() == params.size() &&
                        steps.size() == params.size() && (!amsgrad || max_exp_avg_sqs.size() == params.size()),
                    name, ": state lists do not match the parameters");
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    optim::detail::check_companion(refs[i], "its state 'exp_avg'", exp_avgs[i], n);
    optim::detail::check_companion(refs[i], "its state 'exp_avg_sq'", exp_avg_sqs[i], n);
    if (amsgrad) optim::detail::check_companion(refs[i], "its state 'max_exp_avg_sq'", max_exp_avg_sqs[i], n);
  }
  py::gil_scoped_release nogil;
  for (size_t i = 0; i < params.size(); ++i) {
    kernels::AdamBuffers b;
    b.param = params[i].data_ptr<float>();
    b.grad = grads[i].data_ptr<float>();
    b.exp_avg = exp_avgs[i].data_ptr<float>();
    b.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    b.max_exp_avg_sq = amsgrad ? max_exp_avg_sqs[i].data_ptr<float>() : nullptr;
    const auto hyper = kernels::make_adam_hyper(lr, beta1, beta2, eps, weight_decay, amsgrad, maximize,
                                                decoupled, steps[i]);
    kernels::adam_update(hyper, b, params[i].numel());
  }
}

using OptTensor = std::optional<at::Tensor>;

at::Tensor value_or_undefined(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }

OptTensor none_if_undefined(const at::Tensor& t) {
  return t.defined() ? OptTensor(t) : std::nullopt;
}

optim::detail::AdamStateTensors state_of(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                         const OptTensor& max_exp_avg_sq,
                                         const OptTensor& exp_avg_absmax,
                                         const OptTensor& exp_avg_sq_absmax) {
  return {exp_avg, exp_avg_sq, value_or_undefined(max_exp_avg_sq),
          value_or_undefined(exp_avg_absmax), value_or_undefined(exp_avg_sq_absmax)};
}

kernels::StateFormat format_named(const std::string& name) {
  if (name == "float32") return kernels::StateFormat::kFp32;
  if (name == "bfloat16") return kernels::StateFormat::kBFloat16;
  TORCH_CHECK_VALUE(name == "blockwise8", "unknown Adam state format '", name,
                    "' (float32, bfloat16 or blockwise8)");
  return kernels::StateFormat::kBlockwise8;
}

// One Adam/AdamW step over parameters with bf16 or 8-bit states, or bf16
// parameters (with states in any format). The format of each state is read
// from its tensors; all must be checked and converted by the caller to what it
// wants. The lists are parallel; optional entries are None where a format has
// no such tensor. `places` name the parameters and seed the stochastic
// rounding of bf16 ones (adam.h).
void adam_step_compact(const std::vector<Place>& places, const std::vector<at::Tensor>& params,
                       const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& exp_avgs,
                       const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<OptTensor>& max_exp_avg_sqs,
                       const std::vector<OptTensor>& exp_avg_absmaxes,
                       const std::vector<OptTensor>& exp_avg_sq_absmaxes,
                       const std::vector<int64_t>& steps, double lr, double beta1, double beta2,
                       double eps, double weight_decay, bool amsgrad, bool maximize,
                       bool decoupled) {
  const char* name = decoupled ? "AdamW" : "Adam";
  auto refs = check_group(name, params, grads, ParamDtypes::kFloat32OrBFloat16, &places);
  const size_t n = params.size();
  TORCH_CHECK_VALUE(exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                        max_exp_avg_sqs.size() == n && exp_avg_absmaxes.size() == n &&
                        exp_avg_sq_absmaxes.size() == n && steps.size() == n,
                    name, ": state lists do not match the parameters");
  std::vector<optim::detail::AdamStateTensors> states;
  std::vector<kernels::StateFormat> formats;
  for (size_t i = 0; i < n; ++i) {
    states.push_back(state_of(exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i], exp_avg_absmaxes[i],
                              exp_avg_sq_absmaxes[i]));
    formats.push_back(optim::detail::check_adam_state(refs[i], states[i], params[i].numel()));
    TORCH_CHECK_VALUE(!amsgrad || formats[i] != kernels::StateFormat::kBlockwise8, refs[i],
                      ": amsgrad is not supported with 8-bit states");
    TORCH_CHECK_VALUE(!amsgrad || states[i].max_exp_avg_sq.defined(), refs[i],
                      ": its state 'max_exp_avg_sq' is missing (amsgrad)");
  }
  py::gil_scoped_release nogil;
  for (size_t i = 0; i < n; ++i) {
    kernels::CompactAdamBuffers b;
    if (params[i].scalar_type() == at::kBFloat16) {
      optim::detail::set_bf16_param_buffers(params[i], grads[i], refs[i].index, steps[i], &b);
    } else {
      b.param = params[i].data_ptr<float>();
      b.grad = grads[i].data_ptr<float>();
    }
    optim::detail::set_state_buffers(states[i], formats[i], amsgrad, &b);
    const auto hyper = kernels::make_adam_hyper(lr, beta1, beta2, eps, weight_decay, amsgrad,
                                                maximize, decoupled, steps[i]);
    kernels::adam_update_compact(hyper, b, params[i].numel());
  }
}

// A parameter's Adam state (checked; the message names `optimizer`'s
// parameter `index`) in format `to`: (exp_avg, exp_avg_sq, max_exp_avg_sq,
// exp_avg_absmax, exp_avg_sq_absmax), None where the format has no tensor.
std::tuple<at::Tensor, at::Tensor, OptTensor, OptTensor, OptTensor> adam_convert_state(
    const std::string& optimizer, int64_t index, int64_t group, int64_t position, int64_t numel,
    const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const OptTensor& max_exp_avg_sq,
    const OptTensor& exp_avg_absmax, const OptTensor& exp_avg_sq_absmax, const std::string& to) {
  const optim::detail::ParamRef ref{optimizer.c_str(), index, static_cast<size_t>(group),
                                    static_cast<size_t>(position)};
  const auto state =
      state_of(exp_avg, exp_avg_sq, max_exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax);
  const auto from = optim::detail::check_adam_state(ref, state, numel);
  const auto target = format_named(to);
  py::gil_scoped_release nogil;
  auto out = optim::detail::convert_adam_state(state, from, target);
  if (target != kernels::StateFormat::kBlockwise8) {
    out.exp_avg_absmax = out.exp_avg_sq_absmax = at::Tensor();
  }
  return {out.exp_avg, out.exp_avg_sq, none_if_undefined(out.max_exp_avg_sq),
          none_if_undefined(out.exp_avg_absmax), none_if_undefined(out.exp_avg_sq_absmax)};
}

// One SGD step; momentum buffers are written (and read unless first_step).
void sgd_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<at::Tensor>& momentum_buffers, const std::vector<bool>& first_step, double lr,
              double momentum, double dampening, double weight_decay, bool nesterov, bool maximize) {
  auto refs = check_group("SGD", params, grads, ParamDtypes::kFloat32);
  const bool has_momentum = momentum != 0;
  TORCH_CHECK_VALUE(!has_momentum || (momentum_buffers.size() == params.size() && first_step.size() == params.size()),
                    "SGD: momentum buffers do not match the parameters");
  if (has_momentum) {
    for (size_t i = 0; i < params.size(); ++i) {
      optim::detail::check_companion(refs[i], "its state 'momentum_buffer'", momentum_buffers[i],
                                     params[i].numel());
    }
  }
  py::gil_scoped_release nogil;
  for (size_t i = 0; i < params.size(); ++i) {
    kernels::SgdBuffers b;
    b.param = params[i].data_ptr<float>();
    b.grad = grads[i].data_ptr<float>();
    b.momentum_buffer = has_momentum ? momentum_buffers[i].data_ptr<float>() : nullptr;
    const auto hyper = kernels::make_sgd_hyper(lr, momentum, dampening, weight_decay, nesterov, maximize,
                                               has_momentum && first_step[i]);
    kernels::sgd_update(hyper, b, params[i].numel());
  }
}

}  // namespace

void bind_optim(py::module_& m) {
  m.def("adam_step", &adam_step);
  m.def("adam_step_compact", &adam_step_compact);
  m.def("adam_convert_state", &adam_convert_state);
  m.attr("adam_min_blockwise8_numel") = optim::kMinBlockwise8Numel;
  m.def("blockwise8_map", [](bool is_signed) {
    return at::from_blob(const_cast<float*>(kernels::blockwise8_map(is_signed)), {256}, at::kFloat)
        .clone();
  });
  m.def("sgd_step", &sgd_step);
  m.def("simd_isa", [] { return std::string(kernels::isa_name(kernels::active_isa())); });
}

}  // namespace python
}  // namespace roundpipe
