// Layer over a libtorch module: one structural clone per device, whose
// parameters and buffers are pointed at the device tensors of the job.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>

#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "engine/layer_handle.h"
#include "engine/rng.h"
#include "roundpipe/layer.h"

namespace roundpipe {
namespace {

NamedTensors to_named(const torch::OrderedDict<std::string, at::Tensor>& dict) {
  NamedTensors out;
  for (const auto& item : dict) out.emplace_back(item.key(), item.value());
  return out;
}

// libtorch's own modules whose forward never draws random numbers, so their
// runs need no keyed generator (which costs a save and restore of its state
// per run). Only leaves: a container may hold a Dropout.
bool is_random_free(const torch::nn::Module& m) {
  if (dynamic_cast<const RandomFree*>(&m) != nullptr) return true;
  static const std::unordered_set<std::string> kLibtorchRandomFree = {
      "torch::nn::LinearImpl", "torch::nn::BilinearImpl", "torch::nn::IdentityImpl", "torch::nn::FlattenImpl",
      "torch::nn::UnflattenImpl", "torch::nn::EmbeddingImpl", "torch::nn::Conv1dImpl", "torch::nn::Conv2dImpl",
      "torch::nn::Conv3dImpl", "torch::nn::LayerNormImpl", "torch::nn::GroupNormImpl",
      "torch::nn::BatchNorm1dImpl", "torch::nn::BatchNorm2dImpl", "torch::nn::BatchNorm3dImpl",
      "torch::nn::ReLUImpl", "torch::nn::ReLU6Impl", "torch::nn::LeakyReLUImpl", "torch::nn::PReLUImpl",
      "torch::nn::GELUImpl", "torch::nn::SiLUImpl", "torch::nn::MishImpl", "torch::nn::TanhImpl",
      "torch::nn::SigmoidImpl", "torch::nn::SoftmaxImpl", "torch::nn::LogSoftmaxImpl", "torch::nn::ELUImpl",
      "torch::nn::SELUImpl", "torch::nn::CELUImpl", "torch::nn::SoftplusImpl", "torch::nn::HardtanhImpl"};
  return m.children().empty() && kLibtorchRandomFree.count(m.name()) > 0;
}

class ModuleLayer final : public LayerHandle {
 public:
  ModuleLayer(torch::nn::AnyModule any, int64_t index)
      : any_(std::move(any)), module_(any_.ptr()), index_(index), random_free_(is_random_free(*module_)) {
    for (const auto& p : module_->named_parameters()) check_on_cpu("parameter", p.key(), p.value());
    for (const auto& b : module_->named_buffers()) check_on_cpu("buffer", b.key(), b.value());
    replica_for(0);  // cloning problems surface at construction
  }

  std::string type_name() const override { return module_->name(); }
  NamedTensors named_parameters() const override { return to_named(module_->named_parameters()); }
  NamedTensors named_buffers() const override { return to_named(module_->named_buffers()); }
  bool is_training() const override { return module_->is_training(); }
  void train(bool on) override { module_->train(on); }
  bool may_draw_random() const override { return !random_free_; }

  std::vector<at::Tensor> bind(int replica, const std::vector<at::Tensor>& params,
                               const std::vector<at::Tensor>& buffers) override {
    Replica& r = replica_for(replica);
    r.module->train(module_->is_training());
    TORCH_INTERNAL_ASSERT(params.size() == r.params.size() && buffers.size() == r.buffers.size());
    auto masters = module_->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      r.params[i].set_data(params[i]);
      r.params[i].requires_grad_(masters[i].requires_grad());
    }
    for (size_t i = 0; i < buffers.size(); ++i) r.buffers[i].set_data(buffers[i]);
    return r.params;
  }

  std::vector<at::Tensor> bound_buffers(int replica) override { return replica_for(replica).buffers; }

  c10::IValue forward(int replica, std::vector<c10::IValue> args, Kwargs kwargs) override {
    Replica& r = replica_for(replica);
    if (r.value_layer != nullptr) return r.value_layer->forward(std::move(args), std::move(kwargs));
    TORCH_CHECK_TYPE(args.size() == 1 && args[0].isTensor() && kwargs.size() == 0, "layer ", index_,
                     " (", type_name(), ") takes one tensor but was called with ", describe(args, kwargs),
                     "; layers that take other values must implement roundpipe::ValueLayer");
    return r.any.forward(args[0].toTensor());
  }

  void unbind(int replica) override {
    Replica& r = replica_for(replica);
    release_replica_tensors(r.params, r.buffers);
  }

  // A clone draws from the global CPU generator and restores it: made on a
  // worker, while the caller seeds or draws from that generator, it would
  // change the caller's random numbers.
  void make_replicas(int count) override {
    for (int r = 0; r < count; ++r) replica_for(r);
  }

 private:
  struct Replica {
    std::shared_ptr<torch::nn::Module> module;
    torch::nn::AnyModule any;        // the same module, typed; used when not a ValueLayer
    ValueLayer* value_layer = nullptr;
    std::vector<at::Tensor> params;  // the replica's own parameter variables
    std::vector<at::Tensor> buffers;
  };

  void check_on_cpu(const char* what, const std::string& name, const at::Tensor& t) const {
    TORCH_CHECK_VALUE(!t.defined() || t.device().is_cpu(), "layer ", index_, " (", module_->name(), ") ",
                      what, " '", name, "' is on ", t.device(),
                      "; RoundPipe keeps the model on the CPU: move it there first");
  }

  static std::string describe(const std::vector<c10::IValue>& args, const Kwargs& kwargs) {
    std::string out = std::to_string(args.size()) + " positional argument(s) (";
    for (size_t i = 0; i < args.size(); ++i) out += (i ? ", " : "") + args[i].tagKind();
    return out + ") and " + std::to_string(kwargs.size()) + " keyword argument(s)";
  }

  // Replicas are made on the user thread (at construction and by
  // make_replicas), before any device runs the layer, so creating one outside
  // mu_ races with nobody; mu_ guards the map, never the clone (which takes
  // the generator lock: holding both would invert lock order).
  Replica& replica_for(int replica) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = replicas_.find(replica);
      if (it != replicas_.end()) return it->second;
    }
    Replica made = make_replica();
    std::lock_guard<std::mutex> lock(mu_);
    return replicas_.emplace(replica, std::move(made)).first->second;
  }

  // A module's parameters and buffers holding no data while this lives
  // (a tensor listed twice is restored last from its first, real, data).
  class SwappedForEmpty {
   public:
    explicit SwappedForEmpty(torch::nn::Module& module) {
      for (const auto& tensors : {module.parameters(), module.buffers()}) {
        for (const at::Tensor& t : tensors) {
          if (!t.defined()) continue;
          swapped_.emplace_back(t, t.variable_data());
          t.set_data(at::empty({0}, t.options()));
        }
      }
    }
    ~SwappedForEmpty() {
      for (auto it = swapped_.rbegin(); it != swapped_.rend(); ++it) it->first.set_data(it->second);
    }
    SwappedForEmpty(const SwappedForEmpty&) = delete;
    SwappedForEmpty& operator=(const SwappedForEmpty&) = delete;

   private:
    std::vector<std::pair<at::Tensor, at::Tensor>> swapped_;  // (variable, its data), in swap order
  };

  // Clones the module without its tensor data, keeping the global random
  // state untouched (clone() re-runs reset(), which may draw random numbers).
  // A replica binds device tensors, so what clone() would copy and draw is
  // dropped at once: the original's tensors are swapped for empty ones while
  // it clones, and reset()'s random fills are skipped, so a replica of a
  // large layer costs neither a copy nor a draw of it. Replicas are made
  // while the model is made, before any call reads the original.
  Replica make_replica() {
    std::lock_guard<std::mutex> rng_lock(cpu_generator_lock());
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    at::Tensor rng_state = generator_state(gen);
    torch::nn::AnyModule clone;
    try {
      SwappedForEmpty swap(*module_);
      without_random_fills([&] { clone = any_.clone(); });
    } catch (const c10::Error& e) {
      set_generator_state(gen, rng_state);
      TORCH_CHECK_VALUE(false, "layer ", index_, " (", module_->name(),
                        ") cannot be cloned: derive it from torch::nn::Cloneable<",
                        module_->name(), "> so each device can run its own replica (",
                        e.what_without_backtrace(), ")");
    }
    set_generator_state(gen, rng_state);
    check_not_aliased(*clone.ptr());
    Replica r;
    r.module = clone.ptr();
    r.any = clone;
    r.value_layer = dynamic_cast<ValueLayer*>(r.module.get());
    for (auto& p : r.module->parameters()) {
      p.set_data(at::empty({0}, p.options()));
      r.params.push_back(p);
    }
    for (auto& b : r.module->buffers()) {
      b.set_data(at::empty({0}, b.options()));
      r.buffers.push_back(b);
    }
    return r;
  }

  // A clone whose reset() re-registers a tensor the module holds (a tied
  // weight passed to its constructor) shares it with the original; binding
  // device tensors to it would overwrite the master copy.
  void check_not_aliased(const torch::nn::Module& clone) const {
    std::unordered_map<const c10::TensorImpl*, std::string> masters;
    for (const auto& p : module_->named_parameters()) masters.emplace(p.value().unsafeGetTensorImpl(), p.key());
    for (const auto& b : module_->named_buffers()) masters.emplace(b.value().unsafeGetTensorImpl(), b.key());
    auto check = [&](const torch::OrderedDict<std::string, at::Tensor>& tensors) {
      for (const auto& t : tensors) {
        auto it = masters.find(t.value().unsafeGetTensorImpl());
        TORCH_CHECK_VALUE(it == masters.end(), "layer ", index_, " (", module_->name(), "): a clone shares '",
                          it->second, "' with the original because reset() registers a tensor the module ",
                          "holds; reset() must create new tensors (register a tied tensor only once, e.g. ",
                          "take it with std::exchange)");
      }
    };
    check(clone.named_parameters());
    check(clone.named_buffers());
  }

  torch::nn::AnyModule any_;
  std::shared_ptr<torch::nn::Module> module_;
  int64_t index_;
  bool random_free_;  // runs skip the keyed generator
  std::mutex mu_;
  std::unordered_map<int, Replica> replicas_;  // guarded by mu_ (entries are stable)
};

}  // namespace

void release_replica_tensors(std::vector<at::Tensor>& params, std::vector<at::Tensor>& buffers) {
  for (auto& p : params) {
    p.mutable_grad().reset();
    p.set_data(at::empty({0}, p.options()));
  }
  for (auto& b : buffers) b.set_data(at::empty({0}, b.options()));
}

std::shared_ptr<LayerHandle> make_module_layer(torch::nn::AnyModule module, int64_t index) {
  return std::make_shared<ModuleLayer>(std::move(module), index);
}

}  // namespace roundpipe
