// RoundPipe's public functions (include/roundpipe/model.h): each is one
// function of the engine's façade (model_impl.h); plus the functions over
// several models (auto_execute_plans, save_timings).
#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>

#include "engine/checking_arguments.h"
#include "engine/engine_access.h"
#include "engine/model_impl.h"
#include "schedule/chrome_trace.h"
#include "util/atomic_file.h"

#include <sstream>

namespace roundpipe {

RoundPipe::RoundPipe(torch::nn::Sequential model, RoundPipeOptions options) {
  TORCH_CHECK_VALUE(!model.is_empty(), "RoundPipe: model is an empty holder");
  const std::string name = options.name;
  impl_ = checking_arguments(name, "constructor", [&] {
    std::vector<std::shared_ptr<LayerHandle>> layers;
    int64_t i = 0;
    for (const auto& any : *model) layers.push_back(make_module_layer(any, i++));
    return Impl::create(std::move(layers), std::move(options), model);
  });
}

namespace {

std::vector<std::shared_ptr<LayerHandle>> checked_layers(
    std::vector<std::shared_ptr<LayerHandle>> layers) {
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK_VALUE(layers[i] != nullptr, "RoundPipe: layer ", i, " of ", layers.size(),
                      " is null");
  }
  return layers;
}

}  // namespace

RoundPipe detail::EngineAccess::from_layers(std::vector<std::shared_ptr<LayerHandle>> layers,
                                            RoundPipeOptions options) {
  const std::string name = options.name;
  RoundPipe model(checking_arguments(name, "constructor", [&] {
    return RoundPipe::Impl::create(checked_layers(std::move(layers)), std::move(options),
                                   torch::nn::Sequential(nullptr));
  }));
  return model;
}

RoundPipe::RoundPipe(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

RoundPipe::~RoundPipe() = default;
RoundPipe::RoundPipe(RoundPipe&&) noexcept = default;
RoundPipe& RoundPipe::operator=(RoundPipe&&) noexcept = default;

c10::IValue RoundPipe::forward(std::vector<c10::IValue> args, Kwargs kwargs,
                               const RunConfig& run_config) {
  return impl_->forward(std::move(args), std::move(kwargs), run_config);
}

at::Tensor RoundPipe::forward(const at::Tensor& input, const RunConfig& run_config) {
  c10::IValue out = forward({input}, make_kwargs(), run_config);
  TORCH_CHECK_TYPE(out.isTensor(), "RoundPipe::forward(Tensor): the model returned ", out.tagKind(),
                   "; use forward(args, kwargs) for non-tensor outputs");
  return out.toTensor();
}

c10::IValue RoundPipe::forward_backward(std::vector<c10::IValue> input_args, Kwargs input_kwargs,
                                        c10::IValue label, const LossFn& loss_fn,
                                        bool return_outputs, const RunConfig& run_config) {
  return impl_->forward_backward(std::move(input_args), std::move(input_kwargs), std::move(label),
                                 loss_fn, return_outputs, run_config);
}

void RoundPipe::train(bool on) { impl_->train(on); }

bool RoundPipe::is_training() const { return impl_->is_training(); }
int64_t RoundPipe::num_layers() const { return impl_->num_layers(); }
const std::string& RoundPipe::name() const { return impl_->name(); }
int64_t RoundPipe::num_devices() const { return impl_->num_devices(); }

ModelExecutePlan RoundPipe::default_execute_plan(RunKind kind) const {
  return impl_->default_execute_plan(kind);
}

const ModelTimer& RoundPipe::timer() const { return impl_->timer(); }
ModelTimer& RoundPipe::timer() { return impl_->timer(); }
LayerCosts RoundPipe::layer_costs() const { return impl_->layer_costs(); }

std::vector<ModelExecutePlan> auto_execute_plans(const std::vector<const RoundPipe*>& models,
                                                 AutoPlanOptions options) {
  TORCH_CHECK_VALUE(!models.empty(), "auto_execute_plans: no model given");
  std::vector<LayerCosts> costs;
  for (const RoundPipe* model : models) {
    TORCH_CHECK_VALUE(model != nullptr, "auto_execute_plans: a model is null");
    costs.push_back(model->layer_costs());
  }
  if (options.min_stages == 0) options.min_stages = models.front()->num_devices();
  return auto_plan(costs, options);
}

void save_timings(const std::string& path, const std::vector<const RoundPipe*>& models) {
  std::ostringstream os;
  os.precision(17);
  os << "{\"format\": \"roundpipe-timings-1\", \"models\": [";
  for (size_t i = 0; i < models.size(); ++i) {
    TORCH_CHECK_VALUE(models[i] != nullptr, "save_timings: a model is null");
    const RoundPipe& model = *models[i];
    const LayerCosts costs = model.layer_costs();
    bool timed = true;
    for (int64_t l = 0; l < costs.num_layers(); ++l) {
      timed = timed && model.timer().num_records(l, LayerAction::kForward) > 0;
    }
    os << (i ? ",\n " : "\n ") << "{\"name\": " << json_quoted(model.name())
       << ", \"timed\": " << (timed ? "true" : "false") << ", \"layers\": [";
    for (int64_t l = 0; l < costs.num_layers(); ++l) {
      os << (l ? ",\n  " : "\n  ") << "{\"fwd_ms\": " << costs.fwd_ms[l]
         << ", \"recompute_ms\": " << costs.recompute_ms[l] << ", \"bwd_ms\": " << costs.bwd_ms[l]
         << ", \"param_bytes\": " << costs.param_bytes[l] << "}";
    }
    os << "]}";
  }
  os << "]}\n";
  try {
    write_file_atomically(path, os.str());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "save_timings: ", e.what_without_backtrace());
  }
}

torch::nn::Sequential& RoundPipe::model() { return impl_->sequential(); }

}  // namespace roundpipe
