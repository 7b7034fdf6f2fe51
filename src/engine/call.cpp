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
  fences.assign(jobs.size(), {});
  records.assign(jobs.size(), JobRecord());
}

Slot Call::wait(const Slot& slot) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return slot.ready || error_ != nullptr; });
  if (error_ != nullptr) throw Cancelled{};
  return slot;
}

Slot Call::take(Slot& slot) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return slot.ready || error_ != nullptr; });
  if (error_ != nullptr) throw Cancelled{};
  Slot out = slot;
  if (slot.device >= 0) slot.value = c10::IValue();
  return out;
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

void Call::job_done() { jobs_done_.finish(); }

void Call::wait_all() {
  std::exception_ptr error;
  std::string context;
  jobs_done_.wait_for(static_cast<int64_t>(jobs.size()));
  // Also after an error: host memory a copy still reads or writes must not
  // be handed back (to the caller, the optimizer) before the copy is done.
  for (const auto& job_fences : fences) {
    for (const auto& fence : job_fences) {
      if (!fence) continue;
      try {
        fence->synchronize();
      } catch (...) {
        fail(std::current_exception(), "in RoundPipe model '" + model.name + "': waiting for a copy");
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    error = error_;
    context = context_;
  }
  if (error != nullptr) rethrow_with_context(error, context);
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

// What loss_fn returned must be something backward can start from: scalar
// tensors that depend on the outputs (checked here, so the message says
// what to change rather than what autograd could not do).
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

// Where a job is, for error messages.
struct Cursor {
  int64_t layer = -1;
  int64_t microbatch = -1;
};

std::string describe(const Call& c, size_t j, const Device& dev, const Cursor& cur) {
  const JobSpec& job = c.jobs[j];
  std::string out = "in RoundPipe model '" + c.model.name + "': " + job_kind_name(job.kind) + " stage " +
                    std::to_string(job.stage) + " (layers " + std::to_string(job.layers.begin) + ".." +
                    std::to_string(job.layers.end - 1) + ")";
  if (cur.layer >= 0) out += ", layer " + std::to_string(cur.layer);
  if (cur.microbatch >= 0) out += ", microbatch " + std::to_string(cur.microbatch);
  return out + ", device " + dev.name();
}

std::vector<at::Tensor> detached(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(t.defined() ? t.detach() : t);
  return out;
}

// The value of `slot` on `dev`, for compute: moved there unless it already
// is; compute waits for the copy (or for the slot's producer).
c10::IValue to_device(Device& dev, const Slot& slot) {
  if (slot.device == dev.index()) {
    dev.compute_wait(slot.fence);
    return slot.value;
  }
  std::vector<at::Tensor> host = flatten_tensors(slot.value);
  if (host.empty()) return slot.value;
  std::vector<at::Tensor> moved = dev.upload(detached(host), Lane::kActUpload, slot.fence);
  dev.compute_wait(dev.lane_fence(Lane::kActUpload));
  return replace_tensors(slot.value, moved);
}

// `value` (on `dev`) handed to device `consumer` (-1: the host). Stays on the
// device when the consumer is the same device.
Slot hand_off(Device& dev, const c10::IValue& value, int64_t consumer) {
  Slot out;
  if (consumer == dev.index()) {
    out.value = value;
    out.device = dev.index();
    out.fence = dev.lane_fence(Lane::kCompute);
    return out;
  }
  std::vector<at::Tensor> tensors = flatten_tensors(value);
  if (tensors.empty()) {
    out.value = value;
    return out;
  }
  out.value = replace_tensors(value, dev.download(detached(tensors)));
  out.fence = dev.lane_fence(Lane::kDownload);
  return out;
}

// Completes once the parameters of the given layers hold write
// `generation`: an upload issued after it waits on its lane, not on the
// worker, so the worker goes on queueing compute.
class ParamGateFence final : public Fence {
 public:
  ParamGateFence(const ParamGate* gate, std::vector<int64_t> layers, int64_t generation)
      : gate_(gate), layers_(std::move(layers)), generation_(generation) {}
  void synchronize() const override {
    for (int64_t l : layers_) gate_->wait(l, generation_);
  }
  bool query() const override {
    for (int64_t l : layers_) {
      if (!gate_->written(l, generation_)) return false;
    }
    return true;
  }

 private:
  const ParamGate* gate_;  // outlives the call, which waits for its copies
  std::vector<int64_t> layers_;
  int64_t generation_;
};

// `value` (a slot's value moved to the device) with every tensor a fresh
// leaf; floating-point tensors require grad (at layer 0 only those of the
// slot's `original` value, the caller's tensors, that required grad).
std::pair<c10::IValue, std::vector<at::Tensor>> make_leaves(const c10::IValue& value,
                                                            const c10::IValue& original,
                                                            int64_t start_layer) {
  std::vector<at::Tensor> host = flatten_tensors(original);
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

int64_t bytes_of(const c10::IValue& value) {
  int64_t bytes = 0;
  for (const at::Tensor& t : flatten_tensors(value)) {
    if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
  }
  return bytes;
}

// Times each layer's backward within one autograd pass over a stage: a hook
// on each layer's output marks when its gradient is complete, which is when
// the backward of the layer after it has finished.
class BackwardTimer {
 public:
  BackwardTimer(Device& dev, LayerRange layers, int64_t microbatch)
      : dev_(dev),
        layers_(layers),
        microbatch_(microbatch),
        boundaries_(std::make_shared<std::vector<MarkPtr>>(layers.end - layers.begin + 1)) {}

  // `output` is what layer l (not the stage's last) returned.
  void watch(int64_t l, const c10::IValue& output) {
    const size_t k = static_cast<size_t>(l + 1 - layers_.begin);
    for (const at::Tensor& t : flatten_tensors(output)) {
      if (!t.defined() || !t.requires_grad()) continue;
      // The last of the output's gradients to complete marks the boundary.
      t.register_hook([boundaries = boundaries_, k, dev = &dev_](const at::Tensor&) {
        (*boundaries)[k] = dev->mark(Lane::kCompute);
      });
    }
  }
  void start() { boundaries_->back() = dev_.mark(Lane::kCompute); }
  // After the backward pass: one record per layer, or per run of layers
  // whose inner boundaries were not marked.
  void finish(std::vector<LayerTimeRecord>& out) {
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

 private:
  Device& dev_;
  LayerRange layers_;
  int64_t microbatch_;
  std::shared_ptr<std::vector<MarkPtr>> boundaries_;  // [k]: before layer begin + k; shared with hooks
};

class JobRunner {
 public:
  JobRunner(Call& c, size_t j, Device& dev)
      : c_(c), j_(j), job_(c.jobs[j]), dev_(dev), record_(c.records[j]) {}

  void run() {
    bind_stage();
    switch (job_.kind) {
      case JobKind::kForward: run_forward(); break;
      case JobKind::kFused: run_fused(); break;
      case JobKind::kBackward: run_backward(); break;
    }
    if (job_.kind != JobKind::kForward) download_grads();
    if (job_.kind != JobKind::kBackward) download_buffers();
  }

  // Drops the device tensors of this job (also after errors, and for a job
  // never run because its call failed) and gives back its stage slot once
  // every copy it issued has completed (`last_use`).
  void release(const std::vector<FencePtr>& last_use) {
    for (int64_t l = job_.layers.begin; l < bound_until_; ++l) {
      (*c_.model.layers)[l]->unbind(dev_.index());
    }
    leaves_.clear();
    if (c_.prefetched[j_].holds_slot) holds_slot_ = true;
    c_.prefetched[j_] = StageTensors();
    if (holds_slot_) dev_.give_back_stage_slot(last_use);
    holds_slot_ = false;
  }

  Cursor cursor;

 private:
  std::shared_ptr<Layer>& layer(int64_t l) { return (*c_.model.layers)[l]; }

  // ---- timeline spans (only when tracing) ----
  MarkPtr mark(Lane lane) { return c_.trace ? dev_.mark(lane) : nullptr; }
  void add_span(TraceLane trace_lane, Lane lane, const char* kind, const char* label, size_t job, int64_t m,
                int64_t bytes, MarkPtr start) {
    if (!c_.trace) return;
    record_.spans.push_back(SpanRecord{trace_lane, kind, label, static_cast<int64_t>(job), m, bytes,
                                       std::move(start), dev_.mark(lane)});
  }

  // The slot's value on this device (an activation hand-off unless it is here).
  c10::IValue fetch(const Slot& slot, int64_t m) {
    if (!c_.trace || slot.device == dev_.index()) return to_device(dev_, slot);
    MarkPtr start = mark(Lane::kActUpload);
    c10::IValue value = to_device(dev_, slot);
    add_span(TraceLane::kActUpload, Lane::kActUpload, "handoff", "act", j_, m, bytes_of(slot.value), start);
    return value;
  }

  // `value` handed to device `consumer` (-1: the host).
  Slot pass_on(const c10::IValue& value, int64_t consumer, int64_t m) {
    if (!c_.trace || consumer == dev_.index()) return hand_off(dev_, value, consumer);
    MarkPtr start = mark(Lane::kDownload);
    Slot out = hand_off(dev_, value, consumer);
    add_span(TraceLane::kDownload, Lane::kDownload, "handoff", "act", j_, m, bytes_of(value), start);
    return out;
  }

  void add_compute_span(int64_t m, MarkPtr start) {
    static const char* const kLabel[] = {"fwd", "fused", "bwd"};
    add_span(TraceLane::kCompute, Lane::kCompute, "compute", kLabel[static_cast<int>(job_.kind)], j_, m, -1,
             std::move(start));
  }

  // Uploads the parameters and buffers of job `job`'s stage in one batch,
  // once the optimizer has written them (a wait on the upload lane).
  StageTensors upload_stage(size_t job) {
    const LayerRange& range = c_.jobs[job].layers;
    const HostStore& store = *c_.model.store;
    MarkPtr start = mark(Lane::kParamUpload);
    std::vector<at::Tensor> host;     // what to upload
    std::vector<int64_t> gated;       // layers whose parameters it reads
    std::unordered_map<int64_t, std::pair<size_t, bool>> source;  // param id -> (index in host, arena?)
    for (int64_t l = range.begin; l < range.end; ++l) {
      const HostLayer& hl = store.layer(l);
      gated.push_back(l);
      if (hl.arena.numel() == 0) continue;
      for (int64_t id : hl.owned) source[id] = {host.size(), true};
      host.push_back(hl.arena);
    }
    for (int64_t l = range.begin; l < range.end; ++l) {
      for (int64_t id : store.layer(l).param_ids) {
        if (source.count(id)) continue;
        // Tied to a layer outside this stage: its master tensor alone.
        gated.push_back(store.params()[id].owner);
        source[id] = {host.size(), false};
        host.push_back(store.params()[id].master.detach());
      }
    }
    const size_t first_buffer = host.size();
    for (int64_t l = range.begin; l < range.end; ++l) {
      for (const auto& [name, b] : layer(l)->named_buffers()) host.push_back(b);
    }
    int64_t bytes = 0;
    for (const at::Tensor& t : host) {
      if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
    }
    StageTensors st;
    std::vector<at::Tensor> moved;
    MarkPtr end;
    if (!host.empty()) {  // a stage without parameters or buffers waits for nothing
      auto gate = std::make_shared<ParamGateFence>(c_.model.gate, std::move(gated), c_.model.generation);
      moved = dev_.upload(host, Lane::kParamUpload, gate);
      end = mark(Lane::kParamUpload);  // before the fence: compute waiting for it starts after the mark
      st.uploaded = dev_.lane_fence(Lane::kParamUpload);
    }
    size_t next_buffer = first_buffer;
    for (int64_t l = range.begin; l < range.end; ++l) {
      std::vector<at::Tensor> params;
      for (int64_t id : store.layer(l).param_ids) {
        const auto& [index, in_arena] = source.at(id);
        params.push_back(in_arena ? store.view_in(moved[index], id) : moved[index]);
      }
      std::vector<at::Tensor> buffers;
      for (size_t b = 0; b < layer(l)->named_buffers().size(); ++b) buffers.push_back(moved[next_buffer++]);
      st.params.push_back(std::move(params));
      st.buffers.push_back(std::move(buffers));
    }
    if (c_.trace) {
      record_.spans.push_back(SpanRecord{TraceLane::kParamUpload, "upload", "params", static_cast<int64_t>(job), -1,
                                         bytes, std::move(start), end ? end : dev_.mark(Lane::kParamUpload)});
    }
    return st;
  }

  // Binds this job's stage (prefetched by the device's previous job, or
  // uploaded now); compute waits for its upload, and only for that.
  void bind_stage() {
    StageTensors st;
    if (c_.prefetched[j_].holds_slot) {
      st = std::move(c_.prefetched[j_]);
      c_.prefetched[j_] = StageTensors();
    } else {
      dev_.take_stage_slot();
      st = upload_stage(j_);
    }
    holds_slot_ = true;
    for (int64_t l = job_.layers.begin; l < job_.layers.end; ++l) {
      cursor.layer = l;
      const size_t i = static_cast<size_t>(l - job_.layers.begin);
      leaves_.push_back(layer(l)->bind(dev_.index(), st.params[i], st.buffers[i]));
      bound_until_ = l + 1;
    }
    cursor.layer = -1;
    dev_.compute_wait(st.uploaded);
  }

  // Uploads the parameters of this device's next job of the call while this
  // one computes, once its first microbatch is queued (so that compute does
  // not wait behind it). Taking the slot may wait for the device's job
  // before this one to finish its copies.
  void prefetch_next() {
    if (prefetch_done_) return;
    prefetch_done_ = true;
    for (size_t k = j_ + 1; k < c_.jobs.size(); ++k) {
      if (c_.jobs[k].device == dev_.index()) {
        dev_.take_stage_slot();
        c_.prefetched[k] = upload_stage(k);
        c_.prefetched[k].holds_slot = true;
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
        for (const Slot& v : *saved) data.push_back(fetch(v, m));
        state.data = std::move(data);
      }
    }
    c10::IValue out;
    dev_.before_layer();
    MarkPtr start = dev_.mark(Lane::kCompute);
    {
      LayerRunScope scope(&state);
      auto body = [&] { out = layer(l)->forward(dev_.index(), std::move(args), std::move(kwargs)); };
      if (c_.preserve_rng && layer(l)->may_draw_random()) {
        run_with_random_stream(dev_.torch_device(),
                               stream_seed(c_.model.seed, c_.record->call_id, l, c_.model.microbatch_offset + m),
                               body);
      } else {
        body();
      }
    }
    record_.layer_times.push_back(LayerTimeRecord{
        LayerRange{l, l + 1}, mode == RunMode::kRecompute ? LayerAction::kRecompute : LayerAction::kForward, m,
        start, dev_.mark(Lane::kCompute)});
    if (mode == RunMode::kSaving && state.saved) {
      std::vector<Slot> host;
      for (const auto& v : *state.data) host.push_back(pass_on(v, -1, m));
      c_.record->recompute_data[l][m] = std::move(host);
    }
    return out;
  }

  void run_forward() {
    at::NoGradGuard no_grad;
    const RunMode mode = c_.saves_for_backward ? RunMode::kSaving : RunMode::kPlain;
    for (int64_t m = 0; m < c_.num_microbatch; ++m) {
      cursor.microbatch = m;
      Slot in = c_.take(c_.flow[j_][m]);
      c10::IValue x = fetch(in, m);
      MarkPtr start = mark(Lane::kCompute);
      for (int64_t l = job_.layers.begin; l < job_.layers.end; ++l) {
        if (c_.saves_for_backward && c_.backward_starts[l]) {
          // Layer 0's input is kept as the caller gave it (autograd history).
          c_.publish(c_.record->stage_inputs[l][m], l == 0 ? in : pass_on(x, -1, m));
        }
        x = run_layer(l, std::move(x), m, mode);
      }
      add_compute_span(m, start);
      c_.publish(c_.flow[j_ + 1][m], pass_on(x, next_device(), m));
      prefetch_next();
    }
  }

  void run_fused() {
    for (int64_t m = 0; m < c_.num_microbatch; ++m) {
      cursor.microbatch = m;
      cursor.layer = -1;
      Slot in = c_.take(c_.flow[j_][m]);
      auto [x, leaves] = make_leaves(fetch(in, m), in.value, job_.layers.begin);
      c10::IValue label = fetch(Slot{c_.labels[m], -1, nullptr, true}, m);
      MarkPtr start = mark(Lane::kCompute);
      c10::IValue loss;
      {
        at::AutoGradMode grad(true);
        BackwardTimer timer(dev_, job_.layers, m);
        for (int64_t l = job_.layers.begin; l < job_.layers.end; ++l) {
          x = run_layer(l, std::move(x), m, RunMode::kPlain);
          if (l + 1 < job_.layers.end) timer.watch(l, x);
        }
        cursor.layer = -1;
        loss = (*c_.loss_fn)(x, label);
        std::vector<at::Tensor> roots = flatten_tensors(loss);
        check_losses(loss, roots);
        timer.start();
        torch::autograd::backward(roots);
        timer.finish(record_.layer_times);
      }
      add_compute_span(m, start);
      c_.losses[m] = pass_on(loss, -1, m).value;
      if (c_.keep_outputs) c_.outputs[m] = pass_on(x, -1, m).value;
      c_.publish(c_.flow[j_ + 1][m], pass_on(leaf_grads(leaves), next_device(), m));
      prefetch_next();
    }
  }

  void run_backward() {
    const LayerRange& range = job_.layers;
    for (int64_t m = 0; m < c_.num_microbatch; ++m) {
      cursor.microbatch = m;
      cursor.layer = -1;
      Slot grad_slot = c_.take(c_.flow[j_][m]);
      Slot input_slot = c_.wait(c_.record->stage_inputs[range.begin][m]);
      std::vector<at::Tensor> grads = tensors_from_ivalue(fetch(grad_slot, m));
      c10::IValue input = fetch(input_slot, m);
      MarkPtr start = mark(Lane::kCompute);
      c10::IValue input_grads;
      if (c_.grain == RecomputeGrain::kStage) {
        auto [x, leaves] = make_leaves(input, input_slot.value, range.begin);
        {
          at::AutoGradMode grad(true);
          BackwardTimer timer(dev_, range, m);
          for (int64_t l = range.begin; l < range.end; ++l) {
            x = run_layer(l, std::move(x), m, RunMode::kRecompute);
            if (l + 1 < range.end) timer.watch(l, x);
          }
          timer.start();
          backward_outputs(x, grads);
          timer.finish(record_.layer_times);
        }
        input_grads = leaf_grads(leaves);
      } else {
        input_grads = backward_layer_by_layer(input, input_slot.value, std::move(grads), m);
      }
      add_compute_span(m, start);
      c_.publish(c_.flow[j_ + 1][m], pass_on(input_grads, next_device(), m));
      prefetch_next();
    }
  }

  // Recomputes the stage without a graph keeping each layer's input, then
  // recomputes and backpropagates one layer at a time, deepest first.
  c10::IValue backward_layer_by_layer(const c10::IValue& input, const c10::IValue& original_input,
                                      std::vector<at::Tensor> grads, int64_t m) {
    const LayerRange& range = job_.layers;
    std::vector<c10::IValue> inputs;  // [layer in stage] on the device
    {
      at::NoGradGuard no_grad;
      inputs.push_back(input);
      for (int64_t l = range.begin; l + 1 < range.end; ++l) {
        inputs.push_back(run_layer(l, inputs.back(), m, RunMode::kRecompute));
      }
    }
    c10::IValue input_grads;
    for (int64_t l = range.end - 1; l >= range.begin; --l) {
      // The stage input keeps the caller's requires_grad flags (layer 0).
      auto [x, leaves] = make_leaves(inputs.back(), l == range.begin ? original_input : inputs.back(), l);
      inputs.pop_back();
      {
        at::AutoGradMode grad(true);
        c10::IValue y = run_layer(l, std::move(x), m, RunMode::kRecompute);
        MarkPtr start = dev_.mark(Lane::kCompute);
        backward_outputs(y, grads);
        record_.layer_times.push_back(
            LayerTimeRecord{LayerRange{l, l + 1}, LayerAction::kBackward, m, start, dev_.mark(Lane::kCompute)});
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
    MarkPtr start = mark(Lane::kDownload);
    int64_t bytes = 0;
    std::vector<at::Tensor> device_grads;
    for (auto& [id, grad] : sums) {
      device_grads.push_back(grad);
      bytes += static_cast<int64_t>(grad.nbytes());
    }
    std::vector<at::Tensor> host = dev_.download(device_grads);  // complete at the job's fences
    for (size_t i = 0; i < sums.size(); ++i) c_.grads[j_].emplace_back(sums[i].first, std::move(host[i]));
    add_span(TraceLane::kDownload, Lane::kDownload, "download", "grads", j_, -1, bytes, start);
  }

  // Buffers updated by this stage's forward persist (recomputation's do not).
  void download_buffers() {
    MarkPtr start = mark(Lane::kDownload);
    int64_t bytes = 0;
    for (int64_t l = job_.layers.begin; l < job_.layers.end; ++l) {
      std::vector<at::Tensor> bufs = layer(l)->bound_buffers(dev_.index());
      if (bufs.empty()) continue;
      for (const auto& b : bufs) {
        if (b.defined()) bytes += static_cast<int64_t>(b.nbytes());
      }
      c_.buffers[j_].emplace_back(l, dev_.download(bufs));  // complete at the job's fences
    }
    if (bytes > 0) add_span(TraceLane::kDownload, Lane::kDownload, "download", "buffers", j_, -1, bytes, start);
  }

  Call& c_;
  size_t j_;
  const JobSpec& job_;
  Device& dev_;
  JobRecord& record_;
  int64_t bound_until_ = 0;
  bool holds_slot_ = false;     // this job's stage slot is taken
  bool prefetch_done_ = false;  // the next job's stage was prefetched (or there is none)
  std::vector<std::vector<at::Tensor>> leaves_;  // [layer in stage][param]
};

}  // namespace

void run_job(Call& c, size_t j, Device& device) {
  {
    JobRunner runner(c, j, device);
    try {
      if (!c.failed()) runner.run();
    } catch (const Cancelled&) {
    } catch (...) {
      c.fail(std::current_exception(), describe(c, j, device, runner.cursor));
    }
    // Everything the job issued, on every lane: the call waits for it, and
    // the job's stage slot is reused only after it.
    std::vector<FencePtr> last_use = device.all_lane_fences();
    c.fences[j] = last_use;
    try {
      runner.release(last_use);
    } catch (...) {
      c.fail(std::current_exception(), describe(c, j, device, runner.cursor));
    }
  }
  c.job_done();  // the last use of the call: its owner may free it now
}

}  // namespace roundpipe
