// RoundPipe: turns calls into jobs, runs them on the device pool, and applies
// their results to the host state once the whole call succeeded.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/nn/modules/container/sequential.h>

#include "engine/call.h"
#include "engine/host_store.h"
#include "engine/layer.h"
#include "engine/rng.h"
#include "engine/value_tree.h"
#include "roundpipe/model.h"
#include "runtime/device_pool.h"

namespace roundpipe {

class RoundPipe::Impl : public std::enable_shared_from_this<RoundPipe::Impl> {
 public:
  Impl(std::vector<std::shared_ptr<Layer>> layers_in, RoundPipeOptions options,
       torch::nn::Sequential seq_in)
      : name(std::move(options.name)),
        defaults(std::move(options.run_config)),
        seq(std::move(seq_in)),
        layers(std::move(layers_in)) {
    TORCH_CHECK_VALUE(!layers.empty(), "RoundPipe: the model has no layers");
    DevicePool& pool = DevicePool::instance();
    TORCH_CHECK_VALUE(options.max_devices >= 0 && options.max_devices <= pool.size(),
                      "RoundPipe: max_devices must be in 0..", pool.size(),
                      " (0 = all devices of the pool), got ", options.max_devices);
    num_devices = options.max_devices == 0 ? pool.size() : options.max_devices;
    seed = options.seed ? *options.seed
                        : static_cast<uint64_t>(at::empty({}, at::kLong).random_().item<int64_t>());
    const bool pinned = !pool.device(0).torch_device().is_cpu();
    store = std::make_unique<HostStore>(layers, pinned);
    for (size_t i = 0; i < layers.size(); ++i) random_use.push_back(std::make_unique<RandomUse>());
    if (defaults.num_microbatch()) check_num_microbatch(*defaults.num_microbatch());
    if (defaults.execute_plan()) defaults.execute_plan()->validate(num_layers(), RunKind::kInfer);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  static void check_num_microbatch(int64_t m) {
    TORCH_CHECK_VALUE(m >= 1, "num_microbatch must be >= 1, got ", m);
  }

  ModelExecutePlan plan_for(const RunConfig& cfg, RunKind kind) const {
    ModelExecutePlan plan = cfg.execute_plan() ? *cfg.execute_plan()
                                               : default_plan(store->layer_param_bytes(), num_devices, kind);
    plan.validate(num_layers(), kind);
    return plan;
  }

  int64_t microbatches_for(const RunConfig& cfg, const std::vector<c10::IValue>& args,
                           const Kwargs& kwargs) const {
    int64_t m = cfg.num_microbatch().value_or(num_devices + 1);
    check_num_microbatch(m);
    const bool split_by_function = cfg.split_input() && cfg.split_input()->fn;
    c10::optional<int64_t> batch = find_batch_size(args, kwargs);
    if (!split_by_function && batch && *batch < m) {
      TORCH_CHECK_VALUE(*batch >= 1, "RoundPipe '", name, "': the batch is empty (dim 0 is 0)");
      TORCH_WARN("RoundPipe '", name, "': num_microbatch ", m, " is larger than the batch size ",
                 *batch, "; using ", *batch);
      m = *batch;
    }
    return m;
  }

  std::shared_ptr<Call> new_call(int64_t m, const RunConfig& cfg) {
    auto call = std::make_shared<Call>();
    call->model = ModelView{name, &layers, store.get(), &random_use, seed, is_training()};
    call->num_microbatch = m;
    call->grain = cfg.recompute_grain().value_or(RecomputeGrain::kStage);
    call->preserve_rng = cfg.preserve_rng_state().value_or(true);
    call->backward_starts.assign(layers.size(), 0);
    return call;
  }

  std::shared_ptr<ForwardRecord> new_record(int64_t m) {
    auto record = std::make_shared<ForwardRecord>();
    record->call_id = next_call_id++;
    record->num_microbatch = m;
    record->stage_inputs.assign(layers.size(), std::vector<Slot>(m));
    record->recompute_data.assign(layers.size(), {});
    for (auto& per_layer : record->recompute_data) per_layer.resize(m);
    return record;
  }

  // Splits the inputs and makes them the first job's input slots: layer 0
  // receives (args, kwargs) packed in one tuple.
  static void feed_inputs(Call& call, const MicrobatchInputs& inputs) {
    for (int64_t m = 0; m < call.num_microbatch; ++m) {
      c10::impl::GenericList args(c10::AnyType::get());
      for (const auto& a : inputs.args[m]) args.push_back(a);
      c10::impl::GenericDict kwargs(c10::StringType::get(), c10::AnyType::get());
      for (const auto& entry : inputs.kwargs[m]) kwargs.insert(entry.key(), entry.value());
      Slot& slot = call.flow[0][m];
      slot.value = c10::ivalue::Tuple::create({args, kwargs});
      slot.ready = true;
    }
  }

  void add_jobs(Call& call, const std::vector<LayerRange>& ranges, JobKind kind, JobKind first_kind) {
    for (size_t s = 0; s < ranges.size(); ++s) {
      call.jobs.push_back(JobSpec{s == 0 ? first_kind : kind, ranges[s], static_cast<int64_t>(s), 0});
    }
  }

  // Runs every job of `call` (its flow already fed) and waits; rethrows the
  // first error.
  void execute(const std::shared_ptr<Call>& call) {
    DevicePool& pool = DevicePool::instance();
    std::vector<int64_t> devices = pool.assign_devices(call->jobs.size(), num_devices);
    for (size_t j = 0; j < call->jobs.size(); ++j) call->jobs[j].device = devices[j];
    std::vector<std::function<void(Device&)>> tasks;
    for (size_t j = 0; j < call->jobs.size(); ++j) {
      tasks.push_back([call, j](Device& dev) { run_job(call, j, dev); });
    }
    pool.submit_batch(devices, tasks);
    call->wait_all();
  }

  // Applies a successful call: gradients into the fp32 accumulators (job
  // order, so the sum does not depend on devices), then forward buffers.
  void commit(const Call& call) {
    auto& params = store->params();
    for (const auto& job_grads : call.grads) {
      for (const auto& [id, grad] : job_grads) {
        at::Tensor& acc = params[id].grad;
        if (acc.defined()) {
          acc.add_(grad);
        } else {
          acc = grad.to(at::kFloat);
        }
      }
    }
    for (const auto& job_buffers : call.buffers) {
      for (const auto& [l, values] : job_buffers) {
        NamedTensors host = layers[l]->named_buffers();
        for (size_t i = 0; i < values.size(); ++i) {
          if (values[i].defined()) host[i].second.detach().copy_(values[i]);
        }
      }
    }
  }

  bool is_training() const { return layers.front()->is_training(); }

  std::string name;
  RunConfig defaults;
  torch::nn::Sequential seq{nullptr};
  std::vector<std::shared_ptr<Layer>> layers;
  std::unique_ptr<HostStore> store;
  std::vector<std::unique_ptr<RandomUse>> random_use;  // [layer]
  int64_t num_devices = 1;
  uint64_t seed = 0;
  int64_t next_call_id = 0;
};

namespace {

MicrobatchInputs split_call_inputs(const std::vector<c10::IValue>& args, const Kwargs& kwargs,
                                   int64_t m, const RunConfig& cfg) {
  return split_inputs(args, kwargs, m, cfg.split_input().value_or(InputSplit{}));
}

c10::IValue sum_losses(const std::vector<c10::IValue>& losses) {
  auto add = [](const c10::IValue& a, const c10::IValue& b) -> c10::IValue {
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

c10::IValue move_outputs(const c10::IValue& merged, const RunConfig& cfg) {
  if (!cfg.output_device() || cfg.output_device()->is_cpu()) return merged;
  const c10::Device device = *cfg.output_device();
  return map_tensors(merged, [&](const at::Tensor& t) { return t.to(device); });
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
    const int64_t n = record_->num_microbatch;
    auto call = m.new_call(n, cfg_);
    call->record = record_;
    m.add_jobs(*call, plan_.bwd_plan, JobKind::kBackward, JobKind::kBackward);
    call->init_flow();
    // Gradients arrive for the outputs of every microbatch, in order.
    size_t next = 0;
    for (int64_t mb = 0; mb < n; ++mb) {
      std::vector<at::Tensor> g;
      for (const at::Tensor& t : flatten_tensors(outputs_[mb])) {
        g.push_back(differentiable(t) ? grads.at(next++) : at::Tensor());
      }
      call->flow[0][mb] = Slot{tensors_to_ivalue(g), -1, nullptr, true};
    }
    m.execute(call);
    m.commit(*call);
    torch::autograd::variable_list input_grads;
    for (int64_t mb = 0; mb < n; ++mb) {
      std::vector<at::Tensor> g = tensors_from_ivalue(call->flow[call->jobs.size()][mb].value);
      std::vector<at::Tensor> ins = flatten_tensors(inputs_[mb]);
      for (size_t i = 0; i < ins.size(); ++i) {
        if (ins[i].requires_grad()) input_grads.push_back(g[i]);
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
  std::vector<std::shared_ptr<Layer>> layers;
  int64_t i = 0;
  for (const auto& any : *model) layers.push_back(make_module_layer(any, i++));
  impl_ = std::make_shared<Impl>(std::move(layers), std::move(options), model);
}

RoundPipe::RoundPipe(std::vector<std::shared_ptr<Layer>> layers, RoundPipeOptions options)
    : impl_(std::make_shared<Impl>(std::move(layers), std::move(options), torch::nn::Sequential(nullptr))) {}

RoundPipe::~RoundPipe() = default;
RoundPipe::RoundPipe(RoundPipe&&) noexcept = default;
RoundPipe& RoundPipe::operator=(RoundPipe&&) noexcept = default;

c10::IValue RoundPipe::forward(std::vector<c10::IValue> args, Kwargs kwargs, const RunConfig& run_config) {
  Impl& m = *impl_;
  const RunConfig cfg = run_config.merged_over(m.defaults);
  const bool requires_grad = cfg.requires_grad().value_or(at::GradMode::is_enabled());
  const RunKind kind = requires_grad ? RunKind::kTrain : RunKind::kInfer;
  const ModelExecutePlan plan = m.plan_for(cfg, kind);
  const int64_t n = m.microbatches_for(cfg, args, kwargs);
  MicrobatchInputs inputs = split_call_inputs(args, kwargs, n, cfg);

  auto call = m.new_call(n, cfg);
  call->record = m.new_record(n);
  call->saves_for_backward = requires_grad;
  for (const auto& r : plan.bwd_plan) call->backward_starts[r.begin] = requires_grad;
  m.add_jobs(*call, plan.fwd_plan, JobKind::kForward, JobKind::kForward);
  call->init_flow();
  Impl::feed_inputs(*call, inputs);
  m.execute(call);
  m.commit(*call);

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
        new PipelineBackward(impl_, call->record, plan, cfg, outputs, packed), torch::autograd::deleteNode);
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
  return move_outputs(merge_outputs(outputs, cfg.merge_output().value_or(OutputMerge{})), cfg);
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
  TORCH_CHECK_VALUE(static_cast<bool>(loss_fn), "forward_backward: loss_fn is empty");
  const RunConfig cfg = run_config.merged_over(m.defaults);
  const ModelExecutePlan plan = m.plan_for(cfg, RunKind::kFused);
  const int64_t n = m.microbatches_for(cfg, input_args, input_kwargs);
  MicrobatchInputs inputs = split_call_inputs(input_args, input_kwargs, n, cfg);

  auto call = m.new_call(n, cfg);
  call->record = m.new_record(n);
  call->saves_for_backward = true;
  for (size_t s = 1; s < plan.bwd_plan.size(); ++s) call->backward_starts[plan.bwd_plan[s].begin] = 1;
  call->labels = split_label(label, n, cfg.split_label().value_or(LabelSplit{}));
  call->loss_fn = &loss_fn;
  call->keep_outputs = return_outputs;
  m.add_jobs(*call, plan.fwd_plan, JobKind::kForward, JobKind::kForward);
  m.add_jobs(*call, plan.bwd_plan, JobKind::kBackward, JobKind::kFused);
  call->init_flow();
  Impl::feed_inputs(*call, inputs);
  m.execute(call);
  m.commit(*call);

  // Gradients for the caller's inputs, through the split (autograd views).
  std::vector<at::Tensor> roots, root_grads;
  for (int64_t mb = 0; mb < n; ++mb) {
    std::vector<at::Tensor> ins = flatten_tensors(call->flow[0][mb].value);
    std::vector<at::Tensor> g = tensors_from_ivalue(call->flow[call->jobs.size()][mb].value);
    for (size_t i = 0; i < ins.size(); ++i) {
      if (ins[i].requires_grad() && g[i].defined()) {
        roots.push_back(ins[i]);
        root_grads.push_back(g[i]);
      }
    }
  }
  if (!roots.empty()) torch::autograd::backward(roots, root_grads);

  c10::IValue loss = sum_losses(call->losses);
  if (!return_outputs) return loss;
  c10::IValue merged = merge_outputs(call->outputs, cfg.merge_output().value_or(OutputMerge{}));
  return c10::ivalue::Tuple::create({loss, move_outputs(merged, cfg)});
}

void RoundPipe::synchronize() {
  for (HostParam& p : impl_->store->params()) {
    if (!p.grad.defined()) continue;
    at::Tensor& grad = p.master.mutable_grad();
    if (grad.defined()) {
      grad.add_(p.grad.to(grad.scalar_type()));
    } else {
      grad = p.grad.to(p.master.scalar_type());
    }
    p.grad = at::Tensor();
  }
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
  return default_plan(impl_->store->layer_param_bytes(), impl_->num_devices, kind);
}

torch::nn::Sequential& RoundPipe::model() {
  TORCH_CHECK(!impl_->seq.is_empty(), "RoundPipe '", impl_->name, "' was not built from a Sequential");
  return impl_->seq;
}

}  // namespace roundpipe
