#include "roundpipe/optim/sgd.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>
#include <torch/types.h>

#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "optim/checks.h"
#include "optim/kernels/kernels.h"

namespace roundpipe {
namespace optim {
namespace {

using torch::optim::OptimizerParamGroup;
using torch::optim::SGDParamState;

constexpr const char* kName = "SGD";

void check_options(const SGDOptions& o, const std::string& where) {
  TORCH_CHECK_VALUE(o.lr() >= 0, "roundpipe::optim::SGD: invalid learning rate ", o.lr(), " in ",
                    where, " (must be >= 0)");
  TORCH_CHECK_VALUE(o.momentum() >= 0, "roundpipe::optim::SGD: invalid momentum value ",
                    o.momentum(), " in ", where, " (must be >= 0)");
  TORCH_CHECK_VALUE(o.weight_decay() >= 0, "roundpipe::optim::SGD: invalid weight_decay value ",
                    o.weight_decay(), " in ", where, " (must be >= 0)");
  TORCH_CHECK_VALUE(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0),
                    "roundpipe::optim::SGD: Nesterov momentum requires a momentum > 0 and zero "
                    "dampening (got momentum ",
                    o.momentum(), ", dampening ", o.dampening(), ") in ", where);
}

SGDOptions& options_of(OptimizerParamGroup& group, size_t index) {
  auto* options = dynamic_cast<SGDOptions*>(&group.options());
  TORCH_CHECK_TYPE(options != nullptr, "roundpipe::optim::SGD: parameter group ", index,
                   " has options of another optimizer; use roundpipe::optim::SGDOptions");
  return *options;
}

void check_groups(std::vector<OptimizerParamGroup>& groups) {
  for (size_t g = 0; g < groups.size(); ++g) {
    check_options(options_of(groups[g], g), "parameter group " + std::to_string(g));
  }
  detail::check_params(kName, groups, detail::ParamDtypes::kFloat32);
}

}  // namespace

// ---- SGDOptions ----------------------------------------------------------

SGDOptions::SGDOptions(double lr) : lr_(lr) {}

bool operator==(const SGDOptions& lhs, const SGDOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.momentum() == rhs.momentum() &&
         lhs.dampening() == rhs.dampening() && lhs.weight_decay() == rhs.weight_decay() &&
         lhs.nesterov() == rhs.nesterov() && lhs.maximize() == rhs.maximize();
}

// libtorch's keys, plus the optional "maximize".
void SGDOptions::serialize(torch::serialize::OutputArchive& archive) const {
  detail::write_option(archive, "lr", lr());
  detail::write_option(archive, "momentum", momentum());
  detail::write_option(archive, "dampening", dampening());
  detail::write_option(archive, "weight_decay", weight_decay());
  detail::write_option(archive, "nesterov", nesterov());
  detail::write_option(archive, "maximize", maximize());
}

void SGDOptions::serialize(torch::serialize::InputArchive& archive) {
  lr(detail::read_option(archive, "lr").toDouble());
  momentum(detail::read_option(archive, "momentum").toDouble());
  dampening(detail::read_option(archive, "dampening").toDouble());
  weight_decay(detail::read_option(archive, "weight_decay").toDouble());
  nesterov(detail::read_option(archive, "nesterov").toBool());
  c10::IValue value;
  maximize(detail::try_read_option(archive, "maximize", &value) && value.toBool());
}

double SGDOptions::get_lr() const { return lr(); }

void SGDOptions::set_lr(const double lr) { this->lr(lr); }

// ---- SGD -----------------------------------------------------------------

SGD::SGD(std::vector<OptimizerParamGroup> param_groups, SGDOptions defaults)
    : torch::optim::Optimizer(
          detail::checked_groups("SGD", std::move(param_groups), detail::ParamDtypes::kFloat32),
          std::make_unique<SGDOptions>(defaults)) {
  check_options(defaults, "the default options");
  check_groups(param_groups_);
}

SGD::SGD(std::vector<torch::Tensor> params, SGDOptions defaults)
    : SGD({OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

torch::Tensor SGD::step(LossClosure closure) {
  torch::Tensor loss = detail::run_closure(closure);
  run_step(nullptr);
  return loss;
}

void SGD::step_with_lowp_copy(const std::vector<torch::Tensor>& lowp_copies) {
  run_step(&lowp_copies);
}

void SGD::run_step(const std::vector<torch::Tensor>* lowp_copies) {
  at::NoGradGuard no_grad;
  // Pass 1: check everything, so that a bad input leaves all unchanged.
  check_groups(param_groups_);
  if (lowp_copies != nullptr) {
    detail::check_lowp_count(kName, lowp_copies->size(), detail::count_params(param_groups_));
  }
  int64_t index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const SGDOptions& options = options_of(param_groups_[g], g);
    const auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i, ++index) {
      const torch::Tensor& p = params[i];
      if (!p.grad().defined()) continue;
      const detail::ParamRef ref{kName, index, g, i};
      const int64_t n = p.numel();
      detail::check_grad(ref, p.grad(), p);
      auto it = state_.find(detail::state_key(p));
      if (options.momentum() != 0 && it != state_.end()) {
        const auto* state = dynamic_cast<const SGDParamState*>(it->second.get());
        TORCH_CHECK_TYPE(state != nullptr, ref, ": its state is not an SGDParamState");
        if (state->momentum_buffer().defined()) {
          detail::check_companion(ref, "its state 'momentum_buffer'", state->momentum_buffer(), n);
        }
      }
      if (lowp_copies != nullptr) detail::check_lowp_copy(ref, (*lowp_copies)[index], n);
    }
  }

  // Pass 2: update.
  index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const SGDOptions& options = options_of(param_groups_[g], g);
    for (const torch::Tensor& p : param_groups_[g].params()) {
      const int64_t param_index = index++;
      if (!p.grad().defined()) continue;
      kernels::SgdBuffers buffers;
      bool first_step = false;
      if (options.momentum() != 0) {
        auto& slot = state_[detail::state_key(p)];
        if (slot == nullptr) slot = std::make_unique<SGDParamState>();
        auto& state = static_cast<SGDParamState&>(*slot);
        // libtorch starts the buffer as a copy of the first gradient.
        if (!state.momentum_buffer().defined()) {
          state.momentum_buffer(torch::empty_like(p, at::MemoryFormat::Contiguous));
          first_step = true;
        }
        buffers.momentum_buffer = state.momentum_buffer().data_ptr<float>();
      }
      const auto hyper = kernels::make_sgd_hyper(
          options.lr(), options.momentum(), options.dampening(), options.weight_decay(),
          options.nesterov(), options.maximize(), first_step);
      buffers.param = p.data_ptr<float>();
      buffers.grad = p.grad().data_ptr<float>();
      std::tie(buffers.lowp, buffers.lowp_kind) = detail::claim_lowp_target(lowp_copies, param_index);
      detail::bump_version(p);
      kernels::sgd_update(hyper, buffers, p.numel());
    }
  }
}

void SGD::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<SGDParamState, SGDOptions>(archive, *this);
}

void SGD::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<SGDParamState, SGDOptions>(archive, *this);
}

}  // namespace optim
}  // namespace roundpipe
