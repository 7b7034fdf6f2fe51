// The update kernels of roundpipe.optim.Adam/AdamW/SGD (python/roundpipe/optim.py
// keeps torch.optim's state layout; these run one step over a parameter group).
#include <vector>

#include "optim/checks.h"
#include "optim/kernels/kernels.h"
#include "python/python_common.h"

namespace roundpipe {
namespace python {
namespace {

using optim::detail::ParamRef;
namespace kernels = optim::kernels;

std::vector<ParamRef> check_group(const char* name, const std::vector<at::Tensor>& params,
                                  const std::vector<at::Tensor>& grads) {
  TORCH_CHECK_VALUE(params.size() == grads.size(), name, ": ", params.size(), " parameters but ", grads.size(),
                    " gradients");
  std::vector<ParamRef> refs;
  for (size_t i = 0; i < params.size(); ++i) {
    ParamRef ref{name, static_cast<int64_t>(i), 0, i};
    optim::detail::check_param(ref, params[i]);
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
  auto refs = check_group(name, params, grads);
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

// One SGD step; momentum buffers are written (and read unless first_step).
void sgd_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<at::Tensor>& momentum_buffers, const std::vector<bool>& first_step, double lr,
              double momentum, double dampening, double weight_decay, bool nesterov, bool maximize) {
  auto refs = check_group("SGD", params, grads);
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
  m.def("sgd_step", &sgd_step);
  m.def("simd_isa", [] { return std::string(kernels::isa_name(kernels::active_isa())); });
}

}  // namespace python
}  // namespace roundpipe
