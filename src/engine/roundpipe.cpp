// RoundPipe: turns calls into jobs, runs them on the device pool, and applies
// their results to the host state once the whole call succeeded.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/nn/modules/container/sequential.h>

#include "batch/batch_split.h"
#include "engine/call.h"
#include "engine/checkpoint_internal.h"
#include "engine/engine_access.h"
#include "engine/host_store.h"
#include "engine/model_impl.h"
#include "util/atomic_file.h"
#include "util/value_tree.h"

#include <sstream>

namespace roundpipe {

namespace {

MicrobatchInputs split_call_inputs(const std::vector<c10::IValue>& args, const Kwargs& kwargs,
                                   int64_t m, const RunConfig& cfg) {
  return split_batch_inputs(args, kwargs, m, cfg.split_input().value_or(InputSplit{}));
}

c10::IValue sum_losses(const std::vector<c10::IValue>& losses) {
  auto add = [](const c10::IValue& a, const c10::IValue& b) -> c10::IValue {
    TORCH_CHECK_TYPE(a.isTensor() == b.isTensor(),
                     "loss_fn returned a tensor for some microbatches and a sequence of tensors for "
                     "others; return the same kind of value for every microbatch");
    if (a.isTensor()) return a.toTensor() + b.toTensor();
    std::vector<at::Tensor> x = flatten_tensors(a), y = flatten_tensors(b);
    TORCH_CHECK_VALUE(x.size() == y.size(), "loss_fn returned sequences of different lengths (",
                      x.size(), " and ", y.size(), ") for different microbatches");
    c10::impl::GenericList out(c10::TensorType::get());
    for (size_t i = 0; i < x.size(); ++i) out.push_back(x[i] + y[i]);
    return out;
  };
  c10::IValue total = losses.front();
  if (!total.isTensor()) total = add(map_tensors(total, [](const at::Tensor& t) { return t * 0; }), total);
  for (size_t m = 1; m < losses.size(); ++m) total = add(total, losses[m]);
  return total;
}

// Runs `f`, which checks and prepares a call's arguments (run config, plan,
// microbatch count, splits); its errors name the model and the call, as the
// errors of the call's jobs do.
template <typename F>
auto checking_arguments(const std::string& model, const char* call, F&& f) {
  try {
    return f();
  } catch (c10::Error& e) {
    e.add_context("in RoundPipe model '" + model + "': " + call);  // same object, same type
    throw;
  }
}

c10::IValue move_outputs(const c10::IValue& merged, const RunConfig& cfg) {
  if (!cfg.output_device() || cfg.output_device()->is_cpu()) return merged;
  const c10::Device device = *cfg.output_device();
  return map_tensors(merged, [&](const at::Tensor& t) { return t.to(device); });
}

// A call's arguments checked and split (written once for every kind of call).
struct PreparedCall {
  int64_t num_microbatch = 0;
  ModelExecutePlan plan;
  MicrobatchInputs inputs;
  std::vector<c10::IValue> labels;  // with a label
};

// The rows the inputs split along (nullopt: none, or a split function).
c10::optional<int64_t> batch_size_of(const RunConfig& cfg, const std::vector<c10::IValue>& args,
                                     const Kwargs& kwargs) {
  return cfg.split_input() ? split_batch_size(args, kwargs, *cfg.split_input()) : find_batch_size(args, kwargs);
}

int64_t microbatches_for(const RoundPipe::Impl& m, const RunConfig& cfg, c10::optional<int64_t> batch) {
  int64_t n = cfg.num_microbatch().value_or(m.num_devices + 1);
  TORCH_CHECK_VALUE(n >= 1, "num_microbatch must be >= 1, got ", n);
  if (batch && *batch < n) {
    TORCH_CHECK_VALUE(*batch >= 1, "the batch is empty (dim 0 of the first input tensor is 0)");
    TORCH_WARN("RoundPipe '", m.name, "': num_microbatch ", n, " is larger than the batch size ", *batch,
               "; using ", *batch);
    n = *batch;
  }
  return n;
}

PreparedCall prepare_call(RoundPipe::Impl& m, const char* what, RunKind kind, const RunConfig& cfg,
                          const std::vector<c10::IValue>& args, const Kwargs& kwargs, const c10::IValue* label) {
  m.begin_call();
  return checking_arguments(m.name, what, [&] {
    PreparedCall p;
    const c10::optional<int64_t> batch = batch_size_of(cfg, args, kwargs);
    p.num_microbatch = microbatches_for(m, cfg, batch);
    p.plan = m.planner.plan_for(cfg, kind, p.num_microbatch);
    if (label) p.labels = split_label(*label, p.num_microbatch, cfg.split_label().value_or(LabelSplit{}), batch);
    p.inputs = split_call_inputs(args, kwargs, p.num_microbatch, cfg);
    return p;
  });
}

// `grad` (host memory) where `input` lives; an undefined one as it is.
at::Tensor on_device_of(const at::Tensor& grad, const at::Tensor& input) {
  if (!grad.defined() || grad.device() == input.device()) return grad;
  return grad.to(input.device());
}

// The autograd node behind forward()'s outputs: its backward runs the
// backward stages through the pipeline.
class PipelineBackward : public torch::autograd::Node {
 public:
  PipelineBackward(std::shared_ptr<RoundPipe::Impl> model, std::shared_ptr<ForwardRecord> record,
                   ModelExecutePlan plan, RunConfig cfg, std::vector<c10::IValue> outputs,
                   std::vector<c10::IValue> inputs)
      : model_(std::move(model)),
        record_(std::move(record)),
        plan_(std::move(plan)),
        cfg_(std::move(cfg)),
        outputs_(std::move(outputs)),
        inputs_(std::move(inputs)) {}

  std::string name() const override { return "RoundPipeBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    RoundPipe::Impl& m = *model_;
    ModelUseLock::Scope use(m.use, "backward");
    const int64_t n = record_->num_microbatch;
    m.begin_call(/*raise_step_error=*/false);  // as loss.backward(), not a call of the model's own
    auto call = m.pipeline.make_call(CallKind::kBackward, plan_, n, cfg_, false, record_);
    // Gradients arrive for the outputs of every microbatch, in order.
    size_t next = 0;
    for (int64_t mb = 0; mb < n; ++mb) {
      std::vector<at::Tensor> g;
      for (const at::Tensor& t : flatten_tensors(outputs_[mb])) {
        g.push_back(differentiable(t) ? grads.at(next++) : at::Tensor());
      }
      call->flow[0][mb] = Slot{tensors_to_ivalue(g), -1, nullptr, true};
    }
    m.pipeline.run(call);
    m.pipeline.commit(*call);
    torch::autograd::variable_list input_grads;
    for (int64_t mb = 0; mb < n; ++mb) {
      std::vector<at::Tensor> g = tensors_from_ivalue(call->flow[call->jobs.size()][mb].value);
      std::vector<at::Tensor> ins = flatten_tensors(inputs_[mb]);
      for (size_t i = 0; i < ins.size(); ++i) {
        // On the input's device: autograd rejects a gradient on another one
        // (the engine hands them back in host memory).
        if (ins[i].requires_grad()) input_grads.push_back(on_device_of(g[i], ins[i]));
      }
    }
    return input_grads;
  }

  static bool differentiable(const at::Tensor& t) {
    return t.defined() && at::isFloatingType(t.scalar_type());
  }

 private:
  std::shared_ptr<RoundPipe::Impl> model_;
  std::shared_ptr<ForwardRecord> record_;
  ModelExecutePlan plan_;
  RunConfig cfg_;
  std::vector<c10::IValue> outputs_;  // [M] host outputs (structure and which tensors get grads)
  std::vector<c10::IValue> inputs_;   // [M] packed inputs (which tensors want grads)
};

}  // namespace

RoundPipe::RoundPipe(torch::nn::Sequential model, RoundPipeOptions options) {
  TORCH_CHECK_VALUE(!model.is_empty(), "RoundPipe: model is an empty holder");
  const std::string name = options.name;
  impl_ = checking_arguments(name, "constructor", [&] {
    std::vector<std::shared_ptr<LayerHandle>> layers;
    int64_t i = 0;
    for (const auto& any : *model) layers.push_back(make_module_layer(any, i++));
    return Impl::create(std::move(layers), std::move(options), model);
  });
  detail::note_live_model(impl_);
}

namespace {

std::vector<std::shared_ptr<LayerHandle>> checked_layers(
    std::vector<std::shared_ptr<LayerHandle>> layers) {
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK_VALUE(layers[i] != nullptr, "RoundPipe: layer ", i, " of ", layers.size(), " is null");
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
  detail::note_live_model(model.impl_);  // found by tensor for the language bindings' checkpoints
  return model;
}

RoundPipe::RoundPipe(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

RoundPipe::~RoundPipe() = default;
RoundPipe::RoundPipe(RoundPipe&&) noexcept = default;
RoundPipe& RoundPipe::operator=(RoundPipe&&) noexcept = default;

c10::IValue RoundPipe::forward(std::vector<c10::IValue> args, Kwargs kwargs, const RunConfig& run_config) {
  Impl& m = *impl_;
  ModelUseLock::Scope use(m.use, "forward");
  const RunConfig cfg = run_config.merged_over(m.defaults);
  const bool requires_grad = cfg.requires_grad().value_or(at::GradMode::is_enabled());
  PreparedCall p = prepare_call(m, "forward", requires_grad ? RunKind::kTrain : RunKind::kInfer, cfg, args, kwargs,
                                nullptr);
  auto call = m.pipeline.make_call(CallKind::kForward, p.plan, p.num_microbatch, cfg, requires_grad);
  Pipeline::feed_inputs(*call, p.inputs);
  m.pipeline.run(call);

  const int64_t n = p.num_microbatch;
  std::vector<c10::IValue> outputs;
  for (const Slot& s : call->flow[call->jobs.size()]) outputs.push_back(s.value);
  if (requires_grad) {
    // Outputs get history from one node whose inputs are the caller's
    // tensors that require grad (plus nothing else: parameters are ours).
    std::vector<c10::IValue> packed;
    torch::autograd::variable_list grad_inputs;
    for (int64_t mb = 0; mb < n; ++mb) {
      packed.push_back(call->flow[0][mb].value);
      for (const at::Tensor& t : flatten_tensors(packed.back())) {
        if (t.requires_grad()) grad_inputs.push_back(t);
      }
    }
    auto node = std::shared_ptr<PipelineBackward>(
        new PipelineBackward(impl_, call->record, p.plan, cfg, outputs, packed), torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(grad_inputs));
    for (auto& out : outputs) {
      out = map_tensors(out, [&](const at::Tensor& t) {
        if (!PipelineBackward::differentiable(t)) return t;
        at::Tensor with_history = t.detach();
        torch::autograd::set_history(with_history, node);
        return with_history;
      });
    }
  }
  // Merged before the results are applied: a merge spec that does not fit
  // (or an output device that cannot be reached) changes nothing.
  c10::IValue merged = checking_arguments(m.name, "forward", [&] {
    return move_outputs(merge_outputs(outputs, cfg.merge_output().value_or(OutputMerge{})), cfg);
  });
  m.pipeline.commit(*call);
  return merged;
}

at::Tensor RoundPipe::forward(const at::Tensor& input, const RunConfig& run_config) {
  c10::IValue out = forward({input}, make_kwargs(), run_config);
  TORCH_CHECK_TYPE(out.isTensor(), "RoundPipe::forward(Tensor): the model returned ", out.tagKind(),
                   "; use forward(args, kwargs) for non-tensor outputs");
  return out.toTensor();
}

c10::IValue RoundPipe::forward_backward(std::vector<c10::IValue> input_args, Kwargs input_kwargs,
                                        c10::IValue label, const LossFn& loss_fn, bool return_outputs,
                                        const RunConfig& run_config) {
  Impl& m = *impl_;
  ModelUseLock::Scope use(m.use, "forward_backward");
  TORCH_CHECK_VALUE(static_cast<bool>(loss_fn), "forward_backward: loss_fn is empty");
  const RunConfig cfg = run_config.merged_over(m.defaults);
  PreparedCall p = prepare_call(m, "forward_backward", RunKind::kFused, cfg, input_args, input_kwargs, &label);
  const int64_t n = p.num_microbatch;
  auto call = m.pipeline.make_call(CallKind::kFused, p.plan, n, cfg, true);
  call->labels = std::move(p.labels);
  call->loss_fn = loss_fn;
  call->keep_outputs = return_outputs;
  Pipeline::feed_inputs(*call, p.inputs);
  // The call returns at its losses, its backward stages still running,
  // unless the caller needs its input gradients now (or the model does not
  // overlap its iterations): then it is finished before returning.
  bool inputs_want_grad = false;
  for (int64_t mb = 0; mb < n; ++mb) {
    for (const at::Tensor& t : flatten_tensors(call->flow[0][mb].value)) {
      inputs_want_grad = inputs_want_grad || t.requires_grad();
    }
  }
  const bool overlap = m.overlap_iterations && !inputs_want_grad;
  m.pipeline.start(call, overlap);
  // The loss and the merged outputs before anything is applied: a merge spec
  // that does not fit (or an output device that cannot be reached) changes
  // nothing.
  c10::IValue loss, merged;
  try {
    checking_arguments(m.name, "forward_backward", [&] {
      loss = sum_losses(call->losses);
      if (return_outputs) {
        merged = move_outputs(merge_outputs(call->outputs, cfg.merge_output().value_or(OutputMerge{})), cfg);
      }
      return 0;
    });
  } catch (...) {
    // Nothing of the call is applied. A call that overlaps stops; one that
    // does not runs to its end first (its timings count, its own failure
    // comes first), as it would have without this error.
    if (overlap) m.pipeline.cancel_in_flight(std::current_exception());
    m.pipeline.discard_in_flight();
    throw;
  }
  if (!overlap) {
    m.pipeline.finish_in_flight();
    // Gradients for the caller's inputs, through the split (autograd views).
    std::vector<at::Tensor> roots, root_grads;
    for (int64_t mb = 0; mb < n; ++mb) {
      std::vector<at::Tensor> ins = flatten_tensors(call->flow[0][mb].value);
      std::vector<at::Tensor> g = tensors_from_ivalue(call->flow[call->jobs.size()][mb].value);
      for (size_t i = 0; i < ins.size(); ++i) {
        if (ins[i].requires_grad() && g[i].defined()) {
          roots.push_back(ins[i]);
          root_grads.push_back(on_device_of(g[i], ins[i]));
        }
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
  }
  if (!return_outputs) return loss;
  return c10::ivalue::Tuple::create({loss, merged});
}

void RoundPipe::train(bool on) {
  if (impl_->seq) {
    impl_->seq->train(on);
  } else {
    for (auto& l : impl_->layers) l->train(on);
  }
}

bool RoundPipe::is_training() const { return impl_->is_training(); }
int64_t RoundPipe::num_layers() const { return impl_->num_layers(); }
const std::string& RoundPipe::name() const { return impl_->name; }
int64_t RoundPipe::num_devices() const { return impl_->num_devices; }

ModelExecutePlan RoundPipe::default_execute_plan(RunKind kind) const {
  impl_->planner.plan(kind, impl_->num_devices + 1);  // starts a search if one is due
  impl_->planner.wait_for_search();
  return impl_->planner.plan(kind, impl_->num_devices + 1);
}

const ModelTimer& RoundPipe::timer() const { return impl_->planner.timer(); }
ModelTimer& RoundPipe::timer() { return impl_->planner.timer(); }
LayerCosts RoundPipe::layer_costs() const { return impl_->planner.layer_costs(); }

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
    os << (i ? ",\n " : "\n ") << "{\"name\": " << json_quoted(model.name()) << ", \"timed\": " << (timed ? "true" : "false")
       << ", \"layers\": [";
    for (int64_t l = 0; l < costs.num_layers(); ++l) {
      os << (l ? ",\n  " : "\n  ") << "{\"fwd_ms\": " << costs.fwd_ms[l] << ", \"recompute_ms\": " << costs.recompute_ms[l]
         << ", \"bwd_ms\": " << costs.bwd_ms[l] << ", \"param_bytes\": " << costs.param_bytes[l] << "}";
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

torch::nn::Sequential& RoundPipe::model() {
  TORCH_CHECK(!impl_->seq.is_empty(), "RoundPipe '", impl_->name, "' was not built from a Sequential");
  return impl_->seq;
}

}  // namespace roundpipe
