// Job execution: what a device worker does for one (stage, all microbatches).
#include "engine/call.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <stdexcept>
#include <typeinfo>
#include <unordered_map>

#include "engine/host_store.h"
#include "engine/rng.h"
#include "engine/value_tree.h"

namespace roundpipe {

// ---- Call bookkeeping ----

void Call::init_flow() {
  flow.assign(jobs.size() + 1, std::vector<Slot>(num_microbatch));
  prefetched.assign(jobs.size(), StageTensors());
  losses.assign(num_microbatch, c10::IValue());
  outputs.assign(num_microbatch, c10::IValue());
  grads.assign(jobs.size(), {});
  buffers.assign(jobs.size(), {});
  fences.assign(jobs.size(), nullptr);
}

Slot Call::wait(const Slot& slot) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return slot.ready || error_ != nullptr; });
  if (error_ != nullptr) throw Cancelled{};
  return slot;
}

void Call::publish(Slot& slot, Slot value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    slot = std::move(value);
    slot.ready = true;
  }
  cv_.notify_all();
}

void Call::fail(std::exception_ptr error, const std::string& context) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_ != nullptr) return;  // the first error wins
    error_ = std::move(error);
    context_ = context;
  }
  cv_.notify_all();
}

bool Call::failed() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_ != nullptr;
}

void Call::job_done() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++jobs_done_;
  }
  cv_.notify_all();
}

void Call::wait_all() {
  std::exception_ptr error;
  std::string context;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return jobs_done_ == static_cast<int64_t>(jobs.size()); });
    error = error_;
    context = context_;
  }
  if (error != nullptr) rethrow_with_context(error, context);
  // Downloads are complete once each job's last download fence is.
  for (const auto& fence : fences) {
    if (fence) fence->synchronize();
  }
}

namespace {

template <typename E>
[[noreturn]] void rethrow_as(const E& e, const std::string& context) {
  throw E(std::string(e.what()) + "\n" + context);
}

}  // namespace

void rethrow_with_context(std::exception_ptr error, const std::string& context) {
  try {
    std::rethrow_exception(error);
  } catch (c10::Error& e) {
    e.add_context(context);  // same object, same type
    throw;
  } catch (std::exception& e) {
    if (auto* contextual = dynamic_cast<ContextualError*>(&e)) {
      contextual->add_context(context);
      throw;
    }
    // Standard exceptions cannot take context in place: rebuild the common
    // ones with the context appended; rethrow anything else unchanged.
    const std::type_info& type = typeid(e);
    if (type == typeid(std::runtime_error)) rethrow_as(static_cast<const std::runtime_error&>(e), context);
    if (type == typeid(std::invalid_argument))
      rethrow_as(static_cast<const std::invalid_argument&>(e), context);
    if (type == typeid(std::out_of_range)) rethrow_as(static_cast<const std::out_of_range&>(e), context);
    if (type == typeid(std::logic_error)) rethrow_as(static_cast<const std::logic_error&>(e), context);
    if (type == typeid(std::domain_error)) rethrow_as(static_cast<const std::domain_error&>(e), context);
    if (type == typeid(std::range_error)) rethrow_as(static_cast<const std::range_error&>(e), context);
    if (type == typeid(std::overflow_error))
      rethrow_as(static_cast<const std::overflow_error&>(e), context);
    throw;
  }
}

// ---- Jobs ----

namespace {

// Where a job is, for error messages.
struct Cursor {
  int64_t layer = -1;
  int64_t microbatch = -1;
};

const char* kind_name(JobKind kind) {
  switch (kind) {
    case JobKind::kForward: return "forward";
    case JobKind::kFused: return "fused";
    case JobKind::kBackward: return "backward";
  }
  return "?";
}

std::string describe(const Call& c, size_t j, const Device& dev, const Cursor& cur) {
  const JobSpec& job = c.jobs[j];
  std::string out = "in RoundPipe model '" + c.model.name + "': " + kind_name(job.kind) + " stage " +
                    std::to_string(job.stage) + " (layers " + std::to_string(job.layers.begin) + ".." +
                    std::to_string(job.layers.end - 1) + ")";
  if (cur.layer >= 0) out += ", layer " + std::to_string(cur.layer);
  if (cur.microbatch >= 0) out += ", microbatch " + std::to_string(cur.microbatch);
  return out + ", device " + dev.name();
}

// The value of `slot` on `dev`: moved there unless it already is.
c10::IValue to_device(Device& dev, const Slot& slot) {
  if (slot.device == dev.index()) {
    dev.compute_wait(slot.fence);
    return slot.value;
  }
  return map_tensors(slot.value, [&](const at::Tensor& t) {
    return t.defined() ? dev.upload(t.detach(), Lane::kActUpload, slot.fence) : t;
  });
}

// `value` (on `dev`) handed to device `consumer` (-1: the host). Stays on the
// device when the consumer is the same device.
Slot hand_off(Device& dev, const c10::IValue& value, int64_t consumer) {
  Slot out;
  if (consumer == dev.index()) {
    out.value = value;
    out.device = dev.index();
    out.fence = dev.compute_fence();
    return out;
  }
  FencePtr fence;  // downloads share one lane: the last fence covers them all
  out.value = map_tensors(value, [&](const at::Tensor& t) {
    return t.defined() ? dev.download(t.detach(), &fence) : t;
  });
  out.fence = fence;
  return out;
}

// `slot` on `dev` with every tensor a fresh leaf; floating-point tensors
// require grad (at layer 0 only those the caller's tensor required).
std::pair<c10::IValue, std::vector<at::Tensor>> make_leaves(Device& dev, const Slot& slot,
                                                            int64_t start_layer) {
  std::vector<at::Tensor> host = flatten_tensors(slot.value);
  c10::IValue value = to_device(dev, slot);
  std::vector<at::Tensor> leaves = flatten_tensors(value);
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (!leaves[i].defined()) continue;
    bool wants_grad = at::isFloatingType(leaves[i].scalar_type()) &&
                      (start_layer != 0 || host[i].requires_grad());
    leaves[i] = leaves[i].detach().requires_grad_(wants_grad);
  }
  return {replace_tensors(value, leaves), leaves};
}

c10::IValue leaf_grads(const std::vector<at::Tensor>& leaves) {
  std::vector<at::Tensor> grads;
  for (const auto& leaf : leaves) {
    grads.push_back(leaf.defined() && leaf.requires_grad() ? leaf.grad() : at::Tensor());
  }
  return tensors_to_ivalue(grads);
}

// Backpropagates `grads` (aligned with flatten_tensors(outputs)).
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

class JobRunner {
 public:
  JobRunner(Call& c, size_t j, Device& dev) : c_(c), j_(j), job_(c.jobs[j]), dev_(dev) {}

  void run() {
    bind_stage();
    prefetch_next();
    switch (job_.kind) {
      case JobKind::kForward: run_forward(); break;
      case JobKind::kFused: run_fused(); break;
      case JobKind::kBackward: run_backward(); break;
    }
    if (job_.kind != JobKind::kForward) download_grads();
    if (job_.kind != JobKind::kBackward) download_buffers();
  }

  // Drops the device tensors of this job (also after errors).
  void release() {
    for (int64_t l = job_.layers.begin; l < bound_until_; ++l) {
      (*c_.model.layers)[l]->unbind(dev_.index());
    }
    leaves_.clear();
    c_.prefetched[j_] = StageTensors();
  }

  Cursor cursor;

 private:
  std::shared_ptr<Layer>& layer(int64_t l) { return (*c_.model.layers)[l]; }

  StageTensors upload_stage(const LayerRange& range) {
    const HostStore& store = *c_.model.store;
    std::unordered_map<int64_t, at::Tensor> on_device;
    for (int64_t l = range.begin; l < range.end; ++l) {
      const HostLayer& hl = store.layer(l);
      c_.model.gate->wait(l, c_.model.generation);
      if (hl.arena.numel() == 0) continue;
      at::Tensor arena = dev_.upload(hl.arena, Lane::kParamUpload, nullptr);
      for (int64_t id : hl.owned) on_device[id] = store.view_in(arena, id);
    }
    StageTensors st;
    for (int64_t l = range.begin; l < range.end; ++l) {
      std::vector<at::Tensor> params;
      for (int64_t id : store.layer(l).param_ids) {
        auto it = on_device.find(id);
        if (it == on_device.end()) {  // tied to a layer outside this stage
          c_.model.gate->wait(store.params()[id].owner, c_.model.generation);
          at::Tensor master = store.params()[id].master.detach();
          it = on_device.emplace(id, dev_.upload(master, Lane::kParamUpload, nullptr)).first;
        }
        params.push_back(it->second);
      }
      std::vector<at::Tensor> buffers;
      for (const auto& [name, b] : layer(l)->named_buffers()) {
        buffers.push_back(b.defined() ? dev_.upload(b, Lane::kParamUpload, nullptr) : b);
      }
      st.params.push_back(std::move(params));
      st.buffers.push_back(std::move(buffers));
    }
    return st;
  }

  void bind_stage() {
    StageTensors st = c_.prefetched[j_].params.empty() ? upload_stage(job_.layers)
                                                        : std::move(c_.prefetched[j_]);
    for (int64_t l = job_.layers.begin; l < job_.layers.end; ++l) {
      cursor.layer = l;
      const size_t i = static_cast<size_t>(l - job_.layers.begin);
      leaves_.push_back(layer(l)->bind(dev_.index(), st.params[i], st.buffers[i]));
      bound_until_ = l + 1;
    }
    cursor.layer = -1;
  }

  // Uploads the parameters of this device's next job of the call while this
  // one computes (at most two stages per device).
  void prefetch_next() {
    for (size_t k = j_ + 1; k < c_.jobs.size(); ++k) {
      if (c_.jobs[k].device == dev_.index()) {
        c_.prefetched[k] = upload_stage(c_.jobs[k].layers);
        return;
      }
    }
  }

  int64_t next_device() const {
    return j_ + 1 < c_.jobs.size() ? c_.jobs[j_ + 1].device : -1;
  }

  c10::IValue run_layer(int64_t l, c10::IValue x, int64_t m, RunMode mode) {
    cursor.layer = l;
    std::vector<c10::IValue> args;
    Kwargs kwargs = make_kwargs();
    if (l == 0) {  // the call's (args, kwargs)
      const auto& packed = x.toTupleRef().elements();
      for (const c10::IValue& a : packed[0].toList()) args.push_back(a);
      kwargs = c10::impl::toTypedDict<std::string, c10::IValue>(packed[1].toGenericDict());
    } else {
      args.push_back(std::move(x));
    }
    LayerRunState state;
    state.mode = mode;
    if (mode == RunMode::kRecompute) {
      const auto& saved = c_.record->recompute_data[l][m];
      if (saved) {
        std::vector<c10::IValue> data;
        for (const auto& v : *saved) data.push_back(to_device(dev_, Slot{v, -1, nullptr, true}));
        state.data = std::move(data);
      }
    }
    c10::IValue out;
    {
      LayerRunScope scope(&state);
      auto body = [&] { out = layer(l)->forward(dev_.index(), std::move(args), std::move(kwargs)); };
      if (c_.preserve_rng) {
        run_with_random_stream(dev_.torch_device(),
                               stream_seed(c_.model.seed, c_.record->call_id, l, m),
                               c_.model.training, *(*c_.model.random_use)[l], body);
      } else {
        body();
      }
    }
    if (mode == RunMode::kSaving && state.saved) {
      std::vector<c10::IValue> host;
      for (const auto& v : *state.data) host.push_back(hand_off(dev_, v, -1).value);
      c_.record->recompute_data[l][m] = std::move(host);
    }
    return out;
  }

  void run_forward() {
    at::NoGradGuard no_grad;
    const RunMode mode = c_.saves_for_backward ? RunMode::kSaving : RunMode::kPlain;
    for (int64_t m = 0; m < c_.num_microbatch; ++m) {
      cursor.microbatch = m;
      Slot in = c_.wait(c_.flow[j_][m]);
      c10::IValue x = to_device(dev_, in);
      for (int64_t l = job_.layers.begin; l < job_.layers.end; ++l) {
        if (c_.saves_for_backward && c_.backward_starts[l]) {
          // Layer 0's input is kept as the caller gave it (autograd history).
          c_.publish(c_.record->stage_inputs[l][m], l == 0 ? in : hand_off(dev_, x, -1));
        }
        x = run_layer(l, std::move(x), m, mode);
      }
      c_.publish(c_.flow[j_ + 1][m], hand_off(dev_, x, next_device()));
    }
  }

  void run_fused() {
    for (int64_t m = 0; m < c_.num_microbatch; ++m) {
      cursor.microbatch = m;
      cursor.layer = -1;
      Slot in = c_.wait(c_.flow[j_][m]);
      auto [x, leaves] = make_leaves(dev_, in, job_.layers.begin);
      c10::IValue loss;
      {
        at::AutoGradMode grad(true);
        for (int64_t l = job_.layers.begin; l < job_.layers.end; ++l) {
          x = run_layer(l, std::move(x), m, RunMode::kPlain);
        }
        cursor.layer = -1;
        c10::IValue label = to_device(dev_, Slot{c_.labels[m], -1, nullptr, true});
        loss = (*c_.loss_fn)(x, label);
        std::vector<at::Tensor> roots = flatten_tensors(loss);
        TORCH_CHECK(!roots.empty() && (loss.isTensor() || loss.isTuple() || loss.isList()),
                    "loss_fn must return a tensor or a sequence of tensors, got ", loss.tagKind());
        torch::autograd::backward(roots);
      }
      c_.losses[m] = hand_off(dev_, loss, -1).value;
      if (c_.keep_outputs) c_.outputs[m] = hand_off(dev_, x, -1).value;
      c_.publish(c_.flow[j_ + 1][m], hand_off(dev_, leaf_grads(leaves), next_device()));
    }
  }

  void run_backward() {
    const LayerRange& range = job_.layers;
    for (int64_t m = 0; m < c_.num_microbatch; ++m) {
      cursor.microbatch = m;
      cursor.layer = -1;
      Slot grad_slot = c_.wait(c_.flow[j_][m]);
      Slot input_slot = c_.wait(c_.record->stage_inputs[range.begin][m]);
      std::vector<at::Tensor> grads = tensors_from_ivalue(to_device(dev_, grad_slot));
      c10::IValue input_grads;
      if (c_.grain == RecomputeGrain::kStage) {
        auto [x, leaves] = make_leaves(dev_, input_slot, range.begin);
        {
          at::AutoGradMode grad(true);
          for (int64_t l = range.begin; l < range.end; ++l) {
            x = run_layer(l, std::move(x), m, RunMode::kRecompute);
          }
          backward_outputs(x, grads);
        }
        input_grads = leaf_grads(leaves);
      } else {
        input_grads = backward_layer_by_layer(input_slot, std::move(grads), m);
      }
      c_.publish(c_.flow[j_ + 1][m], hand_off(dev_, input_grads, next_device()));
    }
  }

  // Recomputes the stage without a graph keeping each layer's input, then
  // recomputes and backpropagates one layer at a time, deepest first.
  c10::IValue backward_layer_by_layer(const Slot& input_slot, std::vector<at::Tensor> grads,
                                      int64_t m) {
    const LayerRange& range = job_.layers;
    std::vector<c10::IValue> inputs;  // [layer in stage] on the device
    {
      at::NoGradGuard no_grad;
      inputs.push_back(to_device(dev_, input_slot));
      for (int64_t l = range.begin; l + 1 < range.end; ++l) {
        inputs.push_back(run_layer(l, inputs.back(), m, RunMode::kRecompute));
      }
    }
    c10::IValue input_grads;
    for (int64_t l = range.end - 1; l >= range.begin; --l) {
      // The stage input keeps the caller's requires_grad flags (layer 0).
      Slot here = l == range.begin ? input_slot : Slot{inputs.back(), dev_.index(), nullptr, true};
      auto [x, leaves] = make_leaves(dev_, here, l);
      inputs.pop_back();
      {
        at::AutoGradMode grad(true);
        backward_outputs(run_layer(l, std::move(x), m, RunMode::kRecompute), grads);
      }
      input_grads = leaf_grads(leaves);
      grads = tensors_from_ivalue(input_grads);
    }
    return input_grads;
  }

  // Sums each parameter's gradient over the stage's layers (tied parameters
  // once, in layer order) and downloads it.
  void download_grads() {
    cursor.layer = -1;
    cursor.microbatch = -1;
    const HostStore& store = *c_.model.store;
    std::vector<std::pair<int64_t, at::Tensor>> sums;
    std::unordered_map<int64_t, size_t> index;
    for (size_t i = 0; i < leaves_.size(); ++i) {
      const auto& ids = store.layer(job_.layers.begin + static_cast<int64_t>(i)).param_ids;
      for (size_t k = 0; k < ids.size(); ++k) {
        const at::Tensor& leaf = leaves_[i][k];
        if (!leaf.requires_grad() || !leaf.grad().defined()) continue;
        auto [it, is_new] = index.emplace(ids[k], sums.size());
        if (is_new) {
          sums.emplace_back(ids[k], leaf.grad());
        } else {
          sums[it->second].second = sums[it->second].second + leaf.grad();
        }
      }
    }
    FencePtr fence;
    for (auto& [id, grad] : sums) c_.grads[j_].emplace_back(id, dev_.download(grad, &fence));
    if (fence) c_.fences[j_] = fence;
  }

  // Buffers updated by this stage's forward persist (recomputation's do not).
  void download_buffers() {
    FencePtr fence = c_.fences[j_];
    for (int64_t l = job_.layers.begin; l < job_.layers.end; ++l) {
      std::vector<at::Tensor> bufs = layer(l)->bound_buffers(dev_.index());
      if (bufs.empty()) continue;
      std::vector<at::Tensor> host;
      for (const auto& b : bufs) host.push_back(b.defined() ? dev_.download(b, &fence) : b);
      c_.buffers[j_].emplace_back(l, std::move(host));
    }
    c_.fences[j_] = fence;
  }

  Call& c_;
  size_t j_;
  const JobSpec& job_;
  Device& dev_;
  int64_t bound_until_ = 0;
  std::vector<std::vector<at::Tensor>> leaves_;  // [layer in stage][param]
};

}  // namespace

void run_job(const std::shared_ptr<Call>& call, size_t j, Device& device) {
  Call& c = *call;
  JobRunner runner(c, j, device);
  try {
    if (!c.failed()) runner.run();
  } catch (const Cancelled&) {
  } catch (...) {
    c.fail(std::current_exception(), describe(c, j, device, runner.cursor));
  }
  try {
    runner.release();
  } catch (...) {
    c.fail(std::current_exception(), describe(c, j, device, runner.cursor));
  }
  c.job_done();
}

}  // namespace roundpipe
