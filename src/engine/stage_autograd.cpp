#include "engine/stage_autograd.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "util/value_tree.h"

namespace roundpipe {

namespace {

// The identity on a leaf, as a tensor that shares its memory but is not
// the leaf itself: a layer may then change its input in place (ReLU with
// inplace=True), which autograd refuses on a leaf that requires grad. The
// layer's input is the stage's own device copy, needed only for the
// gradient that reaches the leaf.
struct StageInput : torch::autograd::Function<StageInput> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& leaf) { return leaf.detach(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return grads;
  }
};

}  // namespace

std::pair<c10::IValue, std::vector<at::Tensor>> make_leaves(const c10::IValue& value,
                                                            const c10::IValue& original,
                                                            int64_t start_layer) {
  std::vector<at::Tensor> host = flatten_tensors(original);
  std::vector<at::Tensor> leaves = flatten_tensors(value);
  std::vector<at::Tensor> inputs(leaves.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (!leaves[i].defined()) continue;
    bool wants_grad = at::isFloatingType(leaves[i].scalar_type()) &&
                      (start_layer != 0 || host[i].requires_grad());
    leaves[i] = leaves[i].detach().requires_grad_(wants_grad);
    at::AutoGradMode grad(true);
    inputs[i] = wants_grad ? StageInput::apply(leaves[i]) : leaves[i];
  }
  return {replace_tensors(value, inputs), leaves};
}

c10::IValue leaf_grads(const std::vector<at::Tensor>& leaves) {
  std::vector<at::Tensor> grads;
  for (const auto& leaf : leaves) {
    grads.push_back(leaf.defined() && leaf.requires_grad() ? leaf.grad() : at::Tensor());
  }
  return tensors_to_ivalue(grads);
}

void backward_outputs(const c10::IValue& outputs, const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> ys = flatten_tensors(outputs);
  TORCH_CHECK(ys.size() == grads.size(), "a recomputed layer returned ", ys.size(),
              " tensors but its forward returned ", grads.size(),
              "; layer outputs must have the same structure in recomputation");
  std::vector<at::Tensor> roots, root_grads;
  for (size_t i = 0; i < ys.size(); ++i) {
    if (ys[i].defined() && ys[i].requires_grad() && grads[i].defined()) {
      roots.push_back(ys[i]);
      root_grads.push_back(grads[i]);
    }
  }
  if (!roots.empty()) torch::autograd::backward(roots, root_grads);
}

void check_losses(const c10::IValue& loss, const std::vector<at::Tensor>& roots) {
  TORCH_CHECK_TYPE(!roots.empty() && (loss.isTensor() || loss.isTuple() || loss.isList()),
                   "loss_fn must return a scalar tensor or a list/tuple of scalar tensors, got ", loss.tagKind());
  for (size_t i = 0; i < roots.size(); ++i) {
    const at::Tensor& t = roots[i];
    TORCH_CHECK_VALUE(t.defined() && t.numel() == 1, "loss_fn must return scalar tensors, but loss ", i,
                      " has shape ", t.defined() ? t.sizes() : at::IntArrayRef{},
                      t.defined() ? "" : " (undefined)", "; reduce it, e.g. with .mean() or .sum()");
    TORCH_CHECK_VALUE(t.requires_grad(), "loss_fn returned a loss (", i,
                      ") that does not require grad: it must be computed from the model's outputs");
  }
}

BackwardTimer::BackwardTimer(Device& dev, LayerRange layers, int64_t microbatch, bool on)
    : dev_(dev),
      layers_(layers),
      microbatch_(microbatch),
      on_(on),
      boundaries_(std::make_shared<std::vector<MarkPtr>>(layers.end - layers.begin + 1)) {}

void BackwardTimer::watch(int64_t l, const c10::IValue& output) {
  if (!on_) return;
  const size_t k = static_cast<size_t>(l + 1 - layers_.begin);
  for (const at::Tensor& t : flatten_tensors(output)) {
    if (!t.defined() || !t.requires_grad()) continue;
    // The last of the output's gradients to complete marks the boundary.
    t.register_hook([boundaries = boundaries_, k, dev = &dev_](const at::Tensor&) {
      (*boundaries)[k] = dev->mark(Lane::kCompute);
    });
  }
}

void BackwardTimer::start() {
  if (on_) boundaries_->back() = dev_.mark(Lane::kCompute);
}

void BackwardTimer::finish(std::vector<LayerTimeRecord>& out) {
  if (!on_) return;
  std::vector<MarkPtr>& b = *boundaries_;
  b.front() = dev_.mark(Lane::kCompute);
  for (size_t hi = b.size() - 1; hi > 0;) {
    size_t lo = hi - 1;
    while (b[lo] == nullptr) --lo;
    out.push_back(LayerTimeRecord{LayerRange{layers_.begin + static_cast<int64_t>(lo),
                                             layers_.begin + static_cast<int64_t>(hi)},
                                  LayerAction::kBackward, microbatch_, b[hi], b[lo]});
    hi = lo;
  }
}

}  // namespace roundpipe
