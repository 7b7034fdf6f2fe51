// The engine's calls: forward, forward_backward, and the backward of a
// forward autograd differentiates (model_impl.h). A call's arguments are
// checked and split before anything changes; its results are applied once
// the whole call succeeded (pipeline.h).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "batch/batch_split.h"
#include "engine/call.h"
#include "engine/checking_arguments.h"
#include "engine/model_impl.h"
#include "util/value_tree.h"

namespace roundpipe {

namespace {

MicrobatchInputs split_call_inputs(const std::vector<c10::IValue>& args, const Kwargs& kwargs,
                                   int64_t m, const RunConfig& cfg) {
  return split_batch_inputs(args, kwargs, m, cfg.split_input().value_or(InputSplit{}));
}

c10::IValue sum_losses(const std::vector<c10::IValue>& losses) {
  auto add = [](const c10::IValue& a, const c10::IValue& b) -> c10::IValue {
    TORCH_CHECK_TYPE(
        a.isTensor() == b.isTensor(),
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
  if (!total.isTensor())
    total = add(map_tensors(total, [](const at::Tensor& t) { return t * 0; }), total);
  for (size_t m = 1; m < losses.size(); ++m) total = add(total, losses[m]);
  return total;
}

c10::IValue move_outputs(const c10::IValue& merged, const RunConfig& cfg) {
  if (!cfg.output_device() || cfg.output_device()->is_cpu()) return merged;
  const c10::Device device = *cfg.output_device();
  return map_tensors(merged, [&](const at::Tensor& t) { return t.to(device); });
}

// The rows the inputs split along (nullopt: none, or a split function).
c10::optional<int64_t> batch_size_of(const RunConfig& cfg, const std::vector<c10::IValue>& args,
                                     const Kwargs& kwargs) {
  return cfg.split_input() ? split_batch_size(args, kwargs, *cfg.split_input())
                           : find_batch_size(args, kwargs);
}

int64_t microbatches_for(const std::string& model, int64_t num_devices, const RunConfig& cfg,
                         c10::optional<int64_t> batch) {
  int64_t n = cfg.num_microbatch().value_or(num_devices + 1);
  check_num_microbatch(n);
  if (batch && *batch < n) {
    TORCH_CHECK_VALUE(*batch >= 1, "the batch is empty (dim 0 of the first input tensor is 0)");
    TORCH_WARN("RoundPipe '", model, "': num_microbatch ", n, " is larger than the batch size ",
               *batch, "; using ", *batch);
    n = *batch;
  }
  return n;
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
    // Gradients arrive for the outputs of every microbatch, in order.
    std::vector<c10::IValue> output_grads;
    size_t next = 0;
    for (const c10::IValue& out : outputs_) {
      std::vector<at::Tensor> g;
      for (const at::Tensor& t : flatten_tensors(out)) {
        g.push_back(differentiable(t) ? grads.at(next++) : at::Tensor());
      }
      output_grads.push_back(tensors_to_ivalue(g));
    }
    std::vector<c10::IValue> in_grads =
        model_->backward(record_, plan_, cfg_, std::move(output_grads));
    torch::autograd::variable_list input_grads;
    for (size_t mb = 0; mb < inputs_.size(); ++mb) {
      std::vector<at::Tensor> g = tensors_from_ivalue(in_grads[mb]);
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

// A call's arguments checked and split (written once for every kind of call).
struct RoundPipe::Impl::PreparedCall {
  int64_t num_microbatch = 0;
  ModelExecutePlan plan;
  MicrobatchInputs inputs;
  std::vector<c10::IValue> labels;  // with a label
};

RoundPipe::Impl::PreparedCall RoundPipe::Impl::prepare_call(const char* what, RunKind kind,
                                                            const RunConfig& cfg,
                                                            const std::vector<c10::IValue>& args,
                                                            const Kwargs& kwargs,
                                                            const c10::IValue* label) {
  begin_call();
  return checking_arguments(name_, what, [&] {
    PreparedCall p;
    const c10::optional<int64_t> batch = batch_size_of(cfg, args, kwargs);
    p.num_microbatch = microbatches_for(name_, num_devices_, cfg, batch);
    p.plan = planner_.plan_for(cfg, kind, p.num_microbatch);
    if (label)
      p.labels =
          split_label(*label, p.num_microbatch, cfg.split_label().value_or(LabelSplit{}), batch);
    p.inputs = split_call_inputs(args, kwargs, p.num_microbatch, cfg);
    return p;
  });
}

std::vector<c10::IValue> RoundPipe::Impl::backward(const std::shared_ptr<ForwardRecord>& record,
                                                   const ModelExecutePlan& plan,
                                                   const RunConfig& cfg,
                                                   std::vector<c10::IValue> output_grads) {
  ModelUseLock::Scope use(use_, "backward");
  const int64_t n = record->num_microbatch;
  begin_call(/*raise_step_error=*/false);  // as loss.backward(), not a call of the model's own
  auto call = pipeline_.make_call(CallKind::kBackward, plan, n, cfg, false, record);
  for (int64_t mb = 0; mb < n; ++mb)
    call->flow[0][mb] = Slot{std::move(output_grads.at(mb)), -1, nullptr, true};
  pipeline_.run(call);
  pipeline_.apply(*call);
  std::vector<c10::IValue> input_grads;
  for (int64_t mb = 0; mb < n; ++mb) input_grads.push_back(call->flow[call->jobs.size()][mb].value);
  return input_grads;
}

c10::IValue RoundPipe::Impl::forward(std::vector<c10::IValue> args, Kwargs kwargs,
                                     const RunConfig& run_config) {
  ModelUseLock::Scope use(use_, "forward");
  const RunConfig cfg = run_config.merged_over(defaults_);
  const bool requires_grad = cfg.requires_grad().value_or(at::GradMode::is_enabled());
  PreparedCall p = prepare_call("forward", requires_grad ? RunKind::kTrain : RunKind::kInfer, cfg,
                                args, kwargs, nullptr);
  auto call = pipeline_.make_call(CallKind::kForward, p.plan, p.num_microbatch, cfg, requires_grad);
  Pipeline::feed_inputs(*call, p.inputs);
  pipeline_.run(call);

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
        new PipelineBackward(shared_from_this(), call->record, p.plan, cfg, outputs, packed),
        torch::autograd::deleteNode);
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
  c10::IValue merged = checking_arguments(name_, "forward", [&] {
    return move_outputs(merge_outputs(outputs, cfg.merge_output().value_or(OutputMerge{})), cfg);
  });
  pipeline_.apply(*call);
  return merged;
}

c10::IValue RoundPipe::Impl::forward_backward(std::vector<c10::IValue> input_args,
                                              Kwargs input_kwargs, c10::IValue label,
                                              const LossFn& loss_fn, bool return_outputs,
                                              const RunConfig& run_config) {
  ModelUseLock::Scope use(use_, "forward_backward");
  TORCH_CHECK_VALUE(static_cast<bool>(loss_fn), "forward_backward: loss_fn is empty");
  const RunConfig cfg = run_config.merged_over(defaults_);
  PreparedCall p =
      prepare_call("forward_backward", RunKind::kFused, cfg, input_args, input_kwargs, &label);
  const int64_t n = p.num_microbatch;
  auto call = pipeline_.make_call(CallKind::kFused, p.plan, n, cfg, true);
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
  const bool overlap = overlap_iterations_ && !inputs_want_grad;
  pipeline_.start(call, overlap);
  // The loss and the merged outputs before anything is applied: a merge spec
  // that does not fit (or an output device that cannot be reached) changes
  // nothing.
  c10::IValue loss, merged;
  try {
    checking_arguments(name_, "forward_backward", [&] {
      loss = sum_losses(call->losses);
      if (return_outputs) {
        merged = move_outputs(
            merge_outputs(call->outputs, cfg.merge_output().value_or(OutputMerge{})), cfg);
      }
      return 0;
    });
  } catch (...) {
    // Nothing of the call is applied. A call that overlaps stops; one that
    // does not runs to its end first (its timings count, its own failure
    // comes first), as it would have without this error.
    if (overlap) pipeline_.cancel_in_flight(std::current_exception());
    pipeline_.discard_in_flight();
    throw;
  }
  if (!overlap) {
    pipeline_.finish_in_flight();
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

}  // namespace roundpipe
