#include "roundpipe/optim/adam.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/optim/serialize.h>
#include <torch/types.h>

#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "optim/adam_state.h"
#include "optim/checks.h"
#include "optim/kernels/kernels.h"

namespace roundpipe {
namespace optim {
namespace {

using torch::optim::OptimizerParamGroup;

// Where the options came from, for messages.
void check_options(const char* name, const AdamOptions& o, const std::string& where) {
  const double beta1 = std::get<0>(o.betas());
  const double beta2 = std::get<1>(o.betas());
  TORCH_CHECK_VALUE(o.lr() >= 0, "roundpipe::optim::", name, ": invalid learning rate ", o.lr(),
                    " in ", where, " (must be >= 0)");
  TORCH_CHECK_VALUE(0 <= beta1 && beta1 < 1, "roundpipe::optim::", name,
                    ": invalid beta parameter at index 0: ", beta1, " in ", where,
                    " (must be in [0, 1))");
  TORCH_CHECK_VALUE(0 <= beta2 && beta2 < 1, "roundpipe::optim::", name,
                    ": invalid beta parameter at index 1: ", beta2, " in ", where,
                    " (must be in [0, 1))");
  TORCH_CHECK_VALUE(o.eps() >= 0, "roundpipe::optim::", name, ": invalid epsilon value ", o.eps(),
                    " in ", where, " (must be >= 0)");
  TORCH_CHECK_VALUE(o.weight_decay() >= 0, "roundpipe::optim::", name,
                    ": invalid weight_decay value ", o.weight_decay(), " in ", where,
                    " (must be >= 0)");
  TORCH_CHECK_VALUE(!(o.amsgrad() && o.state_dtype() == StateDtype::kBlockwise8),
                    "roundpipe::optim::", name, ": amsgrad is not supported with 8-bit states in ",
                    where, " (use state_dtype(StateDtype::kBFloat16) or kFloat32 for amsgrad)");
}

AdamOptions& options_of(const char* name, OptimizerParamGroup& group, size_t index) {
  auto* options = dynamic_cast<AdamOptions*>(&group.options());
  TORCH_CHECK_TYPE(options != nullptr, "roundpipe::optim::", name, ": parameter group ", index,
                   " has options of another optimizer; use roundpipe::optim::AdamOptions");
  return *options;
}

void check_groups(const char* name, std::vector<OptimizerParamGroup>& groups) {
  for (size_t g = 0; g < groups.size(); ++g) {
    check_options(name, options_of(name, groups[g], g), "parameter group " + std::to_string(g));
  }
  detail::check_params(name, groups, detail::ParamDtypes::kFloat32OrBFloat16);
}

// The state of `slot` as our AdamParamState: a libtorch AdamParamState (put
// there by hand) is copied into one; anything else is a c10::TypeError.
AdamParamState& our_state(const detail::ParamRef& ref,
                          std::unique_ptr<torch::optim::OptimizerParamState>& slot) {
  if (auto* ours = dynamic_cast<AdamParamState*>(slot.get())) return *ours;
  const auto* theirs = dynamic_cast<const torch::optim::AdamParamState*>(slot.get());
  TORCH_CHECK_TYPE(theirs != nullptr, ref, ": its state is not an AdamParamState");
  auto ours = std::make_unique<AdamParamState>();
  static_cast<torch::optim::AdamParamState&>(*ours) = *theirs;
  slot = std::move(ours);
  return static_cast<AdamParamState&>(*slot);
}

const torch::optim::AdamParamState& checked_state_type(
    const detail::ParamRef& ref, const torch::optim::OptimizerParamState& state) {
  const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(&state);
  TORCH_CHECK_TYPE(s != nullptr, ref, ": its state is not an AdamParamState");
  return *s;
}

detail::AdamStateTensors tensors_of(const torch::optim::AdamParamState& s) {
  detail::AdamStateTensors t{s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq(), {}, {}};
  if (const auto* ours = dynamic_cast<const AdamParamState*>(&s)) {
    t.exp_avg_absmax = ours->exp_avg_absmax();
    t.exp_avg_sq_absmax = ours->exp_avg_sq_absmax();
  }
  return t;
}

}  // namespace

// ---- AdamParamState ------------------------------------------------------

std::unique_ptr<torch::optim::OptimizerParamState> AdamParamState::clone() const {
  return std::make_unique<AdamParamState>(*this);
}

void AdamParamState::serialize(torch::serialize::InputArchive& archive) {
  torch::optim::AdamParamState::serialize(archive);
  c10::IValue value;
  if (archive.try_read("exp_avg_absmax", value)) exp_avg_absmax(value.toTensor());
  if (archive.try_read("exp_avg_sq_absmax", value)) exp_avg_sq_absmax(value.toTensor());
}

void AdamParamState::serialize(torch::serialize::OutputArchive& archive) const {
  torch::optim::AdamParamState::serialize(archive);
  if (exp_avg_absmax().defined()) archive.write("exp_avg_absmax", exp_avg_absmax());
  if (exp_avg_sq_absmax().defined()) archive.write("exp_avg_sq_absmax", exp_avg_sq_absmax());
}

const char* state_dtype_name(StateDtype dtype) {
  switch (dtype) {
    case StateDtype::kFloat32:
      return "float32";
    case StateDtype::kBFloat16:
      return "bfloat16";
    case StateDtype::kBlockwise8:
      return "blockwise8";
  }
  return "unknown";
}

// ---- AdamOptions ---------------------------------------------------------

AdamOptions::AdamOptions(double lr) : lr_(lr) {}

AdamWOptions::AdamWOptions(double lr) : AdamOptions(lr) {
  weight_decay(1e-2);
  decoupled_weight_decay(true);
}

bool operator==(const AdamOptions& lhs, const AdamOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.betas() == rhs.betas() && lhs.eps() == rhs.eps() &&
         lhs.weight_decay() == rhs.weight_decay() && lhs.amsgrad() == rhs.amsgrad() &&
         lhs.maximize() == rhs.maximize() &&
         lhs.decoupled_weight_decay() == rhs.decoupled_weight_decay() &&
         lhs.state_dtype() == rhs.state_dtype();
}

// libtorch's keys first; the two extra ones are optional when loading, so
// archives written by torch::optim::Adam load too.
void AdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  detail::write_option(archive, "lr", lr());
  detail::write_option(archive, "betas", betas());
  detail::write_option(archive, "eps", eps());
  detail::write_option(archive, "weight_decay", weight_decay());
  detail::write_option(archive, "amsgrad", amsgrad());
  detail::write_option(archive, "maximize", maximize());
  detail::write_option(archive, "decoupled_weight_decay", decoupled_weight_decay());
}

void AdamOptions::serialize(torch::serialize::InputArchive& archive) {
  lr(detail::read_option(archive, "lr").toDouble());
  betas(detail::read_option(archive, "betas").to<betas_t>());
  eps(detail::read_option(archive, "eps").toDouble());
  weight_decay(detail::read_option(archive, "weight_decay").toDouble());
  amsgrad(detail::read_option(archive, "amsgrad").toBool());
  c10::IValue value;
  maximize(detail::try_read_option(archive, "maximize", &value) && value.toBool());
  decoupled_weight_decay(detail::try_read_option(archive, "decoupled_weight_decay", &value) &&
                         value.toBool());
}

double AdamOptions::get_lr() const { return lr(); }

void AdamOptions::set_lr(const double lr) { this->lr(lr); }

// ---- Adam ----------------------------------------------------------------

Adam::Adam(const char* name, std::vector<OptimizerParamGroup> param_groups, AdamOptions defaults)
    : torch::optim::Optimizer(detail::checked_groups(name, std::move(param_groups),
                                                     detail::ParamDtypes::kFloat32OrBFloat16),
                              std::make_unique<AdamOptions>(defaults)),
      name_(name) {
  check_options(name_, defaults, "the default options");
  check_groups(name_, param_groups_);
}

Adam::Adam(std::vector<OptimizerParamGroup> param_groups, AdamOptions defaults)
    : Adam("Adam", std::move(param_groups), std::move(defaults)) {}

Adam::Adam(std::vector<torch::Tensor> params, AdamOptions defaults)
    : Adam("Adam", {OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

torch::Tensor Adam::step(LossClosure closure) {
  torch::Tensor loss = detail::run_closure(closure);
  run_step(nullptr);
  return loss;
}

void Adam::step_with_lowp_copy(const std::vector<torch::Tensor>& lowp_copies) {
  run_step(&lowp_copies);
}

void Adam::run_step(const std::vector<torch::Tensor>* lowp_copies) {
  at::NoGradGuard no_grad;
  // Pass 1: check everything, so that a bad input leaves all unchanged.
  check_groups(name_, param_groups_);
  if (lowp_copies != nullptr) {
    detail::check_lowp_count(name_, lowp_copies->size(), detail::count_params(param_groups_));
  }
  int64_t index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i, ++index) {
      const torch::Tensor& p = params[i];
      if (!p.grad().defined()) continue;
      const detail::ParamRef ref{name_, index, g, i};
      const int64_t n = p.numel();
      detail::check_grad(ref, p.grad(), p);
      auto it = state_.find(detail::state_key(p));
      if (it != state_.end()) {
        const auto& state = checked_state_type(ref, *it->second);
        detail::check_adam_state(ref, tensors_of(state), n);
      }
      if (lowp_copies != nullptr) {
        detail::check_lowp_copy(ref, (*lowp_copies)[index], n);
        TORCH_CHECK_VALUE(p.scalar_type() != at::kBFloat16 || !(*lowp_copies)[index].defined(), ref,
                          ": the parameter is bfloat16 itself and has no separate low-precision "
                          "copy; pass an undefined tensor for it");
      }
    }
  }

  // Pass 2: update.
  index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const AdamOptions& options = options_of(name_, param_groups_[g], g);
    const auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor& p = params[i];
      const int64_t param_index = index++;
      if (!p.grad().defined()) continue;
      auto& slot = state_[detail::state_key(p)];
      const detail::ParamRef ref{name_, param_index, g, i};
      const auto format = detail::adam_state_format(options.state_dtype(), p.numel());
      if (slot == nullptr) {
        auto state = std::make_unique<AdamParamState>();
        state->step(0);
        detail::set_state_tensors(detail::zero_adam_state(p, format, /*amsgrad=*/false),
                                  state.get());
        slot = std::move(state);
      }
      auto& state = our_state(ref, slot);
      auto tensors = detail::state_tensors_of(state);
      const auto stored = detail::check_adam_state(ref, tensors, p.numel());
      if (stored != format) {
        tensors = detail::convert_adam_state(tensors, stored, format);
        detail::set_state_tensors(tensors, &state);
      }
      // Also when amsgrad was switched on after the state was created: the
      // running maximum starts at 0, i.e. at the current exp_avg_sq.
      if (options.amsgrad() && !state.max_exp_avg_sq().defined()) {
        state.max_exp_avg_sq(detail::zero_adam_state(p, format, /*amsgrad=*/true).max_exp_avg_sq);
        tensors.max_exp_avg_sq = state.max_exp_avg_sq();
      }
      state.step(state.step() + 1);
      const auto hyper = kernels::make_adam_hyper(
          options.lr(), std::get<0>(options.betas()), std::get<1>(options.betas()), options.eps(),
          options.weight_decay(), options.amsgrad(), options.maximize(),
          options.decoupled_weight_decay(), state.step());
      const auto lowp = detail::claim_lowp_target(lowp_copies, param_index);
      detail::bump_version(p);
      if (p.scalar_type() == at::kBFloat16) {
        kernels::CompactAdamBuffers buffers;
        detail::set_bf16_param_buffers(p, p.grad(), param_index, state.step(), &buffers);
        detail::set_state_buffers(tensors, format, options.amsgrad(), &buffers);
        kernels::adam_update_compact(hyper, buffers, p.numel());
      } else if (format == kernels::StateFormat::kFp32) {
        kernels::AdamBuffers buffers;
        buffers.param = p.data_ptr<float>();
        buffers.grad = p.grad().data_ptr<float>();
        buffers.exp_avg = state.exp_avg().data_ptr<float>();
        buffers.exp_avg_sq = state.exp_avg_sq().data_ptr<float>();
        if (options.amsgrad()) buffers.max_exp_avg_sq = state.max_exp_avg_sq().data_ptr<float>();
        std::tie(buffers.lowp, buffers.lowp_kind) = lowp;
        kernels::adam_update(hyper, buffers, p.numel());
      } else {
        kernels::CompactAdamBuffers buffers;
        buffers.param = p.data_ptr<float>();
        buffers.grad = p.grad().data_ptr<float>();
        std::tie(buffers.lowp, buffers.lowp_kind) = lowp;
        detail::set_state_buffers(tensors, format, options.amsgrad(), &buffers);
        kernels::adam_update_compact(hyper, buffers, p.numel());
      }
    }
  }
}

void Adam::save(torch::serialize::OutputArchive& archive) const {
  // Written through libtorch's base type: serialize() is virtual, so our
  // states add their absmax keys, and a libtorch state put there by hand is
  // written as it is.
  torch::optim::serialize<torch::optim::AdamParamState, AdamOptions>(archive, *this);
}

void Adam::load(torch::serialize::InputArchive& archive) {
  // Kept to restore on failure, and because state_dtype is this optimizer's,
  // not the archive's.
  std::vector<StateDtype> dtypes;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    dtypes.push_back(options_of(name_, param_groups_[g], g).state_dtype());
  }
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> old_options;
  for (const auto& group : param_groups_) old_options.push_back(group.options().clone());
  decltype(state_) old_state;
  for (const auto& [key, value] : state_) old_state[key] = value->clone();
  try {
    torch::optim::serialize<AdamParamState, AdamOptions>(archive, *this);
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      options_of(name_, param_groups_[g], g).state_dtype(dtypes[g]);
    }
    // Check everything, then convert.
    std::vector<std::pair<AdamParamState*, kernels::StateFormat>> stored;
    int64_t index = 0;
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      const auto& params = param_groups_[g].params();
      for (size_t i = 0; i < params.size(); ++i, ++index) {
        auto it = state_.find(detail::state_key(params[i]));
        if (it == state_.end()) continue;
        const detail::ParamRef ref{name_, index, g, i};
        auto& state = our_state(ref, it->second);
        stored.emplace_back(&state, detail::check_adam_state(ref, detail::state_tensors_of(state),
                                                             params[i].numel()));
      }
    }
    size_t k = 0;
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      for (const auto& p : param_groups_[g].params()) {
        if (state_.find(detail::state_key(p)) == state_.end()) continue;
        auto [state, from] = stored[k++];
        const auto to = detail::adam_state_format(dtypes[g], p.numel());
        if (from != to) {
          detail::set_state_tensors(
              detail::convert_adam_state(detail::state_tensors_of(*state), from, to), state);
        }
      }
    }
  } catch (...) {
    state_ = std::move(old_state);
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      param_groups_[g].set_options(std::move(old_options[g]));
    }
    throw;
  }
}

// ---- AdamW ---------------------------------------------------------------

AdamW::AdamW(std::vector<OptimizerParamGroup> param_groups, AdamOptions defaults)
    : Adam("AdamW", std::move(param_groups), std::move(defaults.decoupled_weight_decay(true))) {
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    options_of("AdamW", param_groups_[g], g).decoupled_weight_decay(true);
  }
}

AdamW::AdamW(std::vector<torch::Tensor> params, AdamOptions defaults)
    : AdamW({OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

void AdamW::load(torch::serialize::InputArchive& archive) {
  Adam::load(archive);
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    options_of("AdamW", param_groups_[g], g).decoupled_weight_decay(true);
  }
}

}  // namespace optim
}  // namespace roundpipe
