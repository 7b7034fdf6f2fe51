#include "engine/job_runner.h"

#include <ATen/ATen.h>

#include <string>
#include <unordered_map>

#include <torch/csrc/autograd/autograd.h>

#include "engine/buffer_watch.h"
#include "engine/host_store.h"
#include "engine/model_use.h"
#include "engine/rng.h"
#include "engine/stage_autograd.h"
#include "engine/transfers.h"
#include "util/value_tree.h"
#include "schedule/lane_program.h"

namespace roundpipe {

static_assert(Device::kStageSlots == kStageSlots, "the runtime's stage slots are the lane programs'");

namespace {

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

class JobRunner {
 public:
  JobRunner(Call& c, size_t j, Device& dev)
      : c_(c),
        j_(j),
        job_(c.jobs[j]),
        program_(c.programs[j]),
        dev_(dev),
        record_(c.records[j]),
        op_fences_(program_.ops.size()) {}

  // Executes the program's operations in order, up to (not including) the
  // slot's give-back, which release() does, also after an error.
  void run() {
    for (size_t i = 0; i < program_.ops.size(); ++i) {
      if (c_.failed()) throw Cancelled{};  // another job failed, or the caller was interrupted
      const LaneOp& op = program_.ops[i];
      cursor.microbatch = op.microbatch;
      cursor.layer = -1;
      switch (op.kind) {
        case OpKind::kTakeSlot: take_slot(op.job); break;
        case OpKind::kUploadStage: upload(op.job, i); break;
        case OpKind::kUploadInput: upload_input(op.microbatch, i); break;
        case OpKind::kCompute: compute(op); break;
        case OpKind::kHandOff: hand_off_result(op.microbatch); break;
        case OpKind::kDownloadGrads: download_grads(); break;
        case OpKind::kDownloadBuffers: download_buffers(); break;
        case OpKind::kGiveBackSlot: break;
      }
    }
  }

  // Drops the device tensors of this job (also after errors, and for a job
  // never run because its call failed) and gives back its stage slot once
  // every copy it issued has completed (`last_use`).
  void release(const std::vector<FencePtr>& last_use) {
    for (int64_t l = job_.layers.begin; l < bound_until_; ++l) {
      (*c_.model.layers)[l]->unbind(dev_.index());
    }
    leaves_.clear();
    watches_.clear();
    own_stage_ = StageTensors();
    if (c_.prefetched[j_].holds_slot) holds_slot_ = true;
    c_.prefetched[j_] = StageTensors();
    if (holds_slot_) dev_.give_back_stage_slot(last_use);
    holds_slot_ = false;
  }

  Cursor cursor;

 private:
  std::shared_ptr<LayerHandle>& layer(int64_t l) { return (*c_.model.layers)[l]; }

  // ---- per-layer times (for plans and the timer) ----
  // Every microbatch is timed only for a trace: otherwise the last one, whose
  // layers run as the others' do, and a device records two events per layer
  // per job rather than per microbatch.
  bool times_layers(int64_t m) const { return c_.trace || m == c_.num_microbatch - 1; }
  MarkPtr layer_mark(int64_t m) { return times_layers(m) ? dev_.mark(Lane::kCompute) : nullptr; }

  // ---- timeline spans (only when tracing) ----
  MarkPtr mark(Lane lane) { return c_.trace ? dev_.mark(lane) : nullptr; }
  // A download starts once the compute before it is done: the lane waits for
  // that first, so the span's start (a device time on accelerators) is not
  // before the compute it downloads.
  MarkPtr download_mark() {
    if (!c_.trace) return nullptr;
    dev_.lane_wait(Lane::kDownload, dev_.lane_fence(Lane::kCompute));
    return dev_.mark(Lane::kDownload);
  }
  void add_span(TraceLane trace_lane, Lane lane, const char* kind, const char* label, size_t job, int64_t m,
                int64_t bytes, MarkPtr start) {
    if (!c_.trace) return;
    record_.spans.push_back(SpanRecord{trace_lane, kind, label, static_cast<int64_t>(job), m, bytes,
                                       std::move(start), dev_.mark(lane)});
  }

  // The slot's value on this device (an activation hand-off unless it is here).
  OnDevice to_device(const Slot& slot, int64_t m) {
    if (!c_.trace || slot.device == dev_.index()) return roundpipe::to_device(dev_, slot);
    MarkPtr start = mark(Lane::kActUpload);
    OnDevice value = roundpipe::to_device(dev_, slot);
    add_span(TraceLane::kActUpload, Lane::kActUpload, "handoff", "act", j_, m, bytes_of(slot.value), start);
    return value;
  }
  // to_device() for compute issued now.
  c10::IValue to_compute(const Slot& slot, int64_t m) {
    OnDevice v = to_device(slot, m);
    dev_.compute_wait(v.fence);
    return v.value;
  }

  // `value` handed to device `consumer` (-1: the host).
  Slot hand_off(const c10::IValue& value, int64_t consumer, int64_t m) {
    if (!c_.trace || consumer == dev_.index()) return roundpipe::hand_off(dev_, value, consumer);
    MarkPtr start = download_mark();
    Slot out = roundpipe::hand_off(dev_, value, consumer);
    add_span(TraceLane::kDownload, Lane::kDownload, "handoff", "act", j_, m, bytes_of(value), start);
    return out;
  }

  int64_t next_device() const { return j_ + 1 < c_.jobs.size() ? c_.jobs[j_ + 1].device : -1; }

  // ---- the operations ----

  // Waits (on the host) until one of the device's stage slots is free, for
  // this job's stage or the prefetch of `job`'s.
  void take_slot(int64_t job) {
    dev_.take_stage_slot();
    if (static_cast<size_t>(job) == j_) {
      holds_slot_ = true;
    } else {
      c_.prefetched[job].holds_slot = true;
    }
  }

  void upload(int64_t job, size_t op) {
    StageTensors st = upload_stage(dev_, c_.model, c_.jobs[job].layers, c_.trace);
    if (c_.trace) {
      if (st.gate_start) {  // the upload waited for the optimizer to write these parameters
        record_.spans.push_back(
            SpanRecord{TraceLane::kParamUpload, "wait", "gate", job, -1, 0, st.gate_start, st.start});
      }
      record_.spans.push_back(SpanRecord{TraceLane::kParamUpload, "upload", "params", job, -1, st.bytes, st.start,
                                         st.end});
    }
    op_fences_[op] = st.uploaded;
    c_.stage_uploaded(job, st.uploaded);  // its host parameters are read once this completes
    if (static_cast<size_t>(job) == j_) {
      own_stage_ = std::move(st);
    } else {  // a later job of this device: it takes the tensors (and the slot) over
      st.holds_slot = c_.prefetched[job].holds_slot;
      c_.prefetched[job] = std::move(st);
    }
  }

  // The job's stage bound to its layers; compute waits for its upload, and
  // only for that.
  void bind_stage() {
    if (c_.prefetched[j_].holds_slot) {
      own_stage_ = std::move(c_.prefetched[j_]);
      c_.prefetched[j_] = StageTensors();
      holds_slot_ = true;
    }
    dev_.compute_wait(own_stage_.uploaded);
    // A forward's buffers are watched for writes: only written ones are
    // downloaded (download_buffers). A backward stage's recomputation
    // keeps none of its writes.
    const bool watch = job_.kind != JobKind::kBackward;
    for (int64_t l = job_.layers.begin; l < job_.layers.end; ++l) {
      cursor.layer = l;
      const size_t i = static_cast<size_t>(l - job_.layers.begin);
      std::vector<at::Tensor>& buffers = own_stage_.buffers[i];
      if (watch) {
        watches_.emplace_back();
        if (!buffers.empty()) buffers = watches_.back().watch(buffers);
      }
      leaves_.push_back(layer(l)->bind(dev_.index(), own_stage_.params[i], buffers));
      bound_until_ = l + 1;
    }
    cursor.layer = -1;
  }

  // Microbatch m's inputs on this device (the upload lane's part; compute
  // waits for the fences in compute()).
  void upload_input(int64_t m, size_t op) {
    // The call's own inputs stay in their slots: the caller's gradients are
    // found through them once the call is done.
    in_ = j_ == 0 ? c_.wait(c_.flow[0][m]) : c_.take(c_.flow[j_][m]);
    OnDevice x = to_device(in_, m);
    x_ = x.value;
    op_fences_[op] = x.fence;
    if (job_.kind == JobKind::kFused) {
      label_ = to_compute(Slot{c_.labels[m], -1, nullptr, true}, m);
    } else if (job_.kind == JobKind::kBackward) {
      saved_in_ = c_.wait(c_.record->stage_inputs[job_.layers.begin][m]);
      saved_ = to_compute(saved_in_, m);
    }
  }

  void compute(const LaneOp& op) {
    for (const OpRef& ref : op.after) {
      if (ref.job == static_cast<int64_t>(j_) && program_.ops[ref.index].kind == OpKind::kUploadInput) {
        dev_.compute_wait(op_fences_[ref.index]);
      } else {  // its stage's upload, here or in an earlier job's program
        bind_stage();
      }
    }
    const int64_t m = op.microbatch;
    MarkPtr start = mark(Lane::kCompute);
    switch (job_.kind) {
      case JobKind::kForward: compute_forward(m); break;
      case JobKind::kFused: compute_fused(m); break;
      case JobKind::kBackward: compute_backward(m); break;
    }
    static const char* const kLabel[] = {"fwd", "fused", "bwd"};
    add_span(TraceLane::kCompute, Lane::kCompute, "compute", kLabel[static_cast<int>(job_.kind)], j_, m, -1,
             std::move(start));
  }

  void hand_off_result(int64_t m) {
    cursor.layer = -1;
    if (job_.kind == JobKind::kFused) {
      Slot loss = hand_off(loss_, -1, m);
      c_.losses[m] = loss.value;
      FencePtr handed = loss.fence;
      if (c_.keep_outputs) {
        Slot outputs = hand_off(outputs_, -1, m);
        c_.outputs[m] = outputs.value;
        if (outputs.fence) handed = outputs.fence;  // the download lane is FIFO: it covers the loss too
      }
      c_.loss_handed(std::move(handed));
    }
    c_.publish(c_.flow[j_ + 1][m], hand_off(x_, next_device(), m));
    in_ = Slot();
    saved_in_ = Slot();
    x_ = label_ = saved_ = loss_ = outputs_ = c10::IValue();
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
        for (const Slot& v : *saved) data.push_back(to_compute(v, m));
        state.data = std::move(data);
      }
    }
    c10::IValue out;
    dev_.before_layer();
    MarkPtr start = layer_mark(m);
    {
      LayerRunScope scope(&state);
      UserCodeScope user(c_.model.name, "layer", l);
      AutocastScope autocast(c_.record->autocast);
      auto body = [&] { out = layer(l)->forward(dev_.index(), std::move(args), std::move(kwargs)); };
      if (c_.preserve_rng && layer(l)->may_draw_random()) {
        run_with_random_stream(dev_.torch_device(),
                               stream_seed(c_.model.seed, c_.record->call_id, l, c_.model.microbatch_offset + m),
                               body);
      } else {
        body();
      }
    }
    if (start) {
      record_.layer_times.push_back(LayerTimeRecord{
          LayerRange{l, l + 1}, mode == RunMode::kRecompute ? LayerAction::kRecompute : LayerAction::kForward, m,
          start, dev_.mark(Lane::kCompute)});
    }
    if (mode == RunMode::kSaving && state.saved) {
      std::vector<Slot> host;
      for (const auto& v : *state.data) host.push_back(hand_off(v, -1, m));
      c_.record->recompute_data[l][m] = std::move(host);
    }
    return out;
  }

  void compute_forward(int64_t m) {
    at::NoGradGuard no_grad;
    const RunMode mode = c_.saves_for_backward ? RunMode::kSaving : RunMode::kPlain;
    c10::IValue x = std::move(x_);
    for (int64_t l = job_.layers.begin; l < job_.layers.end; ++l) {
      if (c_.saves_for_backward && c_.backward_starts[l]) {
        if (l == job_.layers.begin && in_.device != dev_.index()) {
          // On the host already (layer 0's as the caller gave it, with its
          // autograd history): x is this device's copy of it.
          c_.publish(c_.record->stage_inputs[l][m], in_);
        } else {
          c_.publish(c_.record->stage_inputs[l][m], hand_off(x, -1, m));
          // The download still reads x: the layer gets its own copy, which
          // it may change in place (e.g. ReLU(inplace=True)).
          x = clone_tensors(x);
        }
      }
      x = run_layer(l, std::move(x), m, mode);
    }
    x_ = std::move(x);
  }

  void compute_fused(int64_t m) {
    auto [x, leaves] = make_leaves(x_, in_.value, job_.layers.begin);
    at::AutoGradMode grad(true);
    BackwardTimer timer(dev_, job_.layers, m, times_layers(m));
    for (int64_t l = job_.layers.begin; l < job_.layers.end; ++l) {
      x = run_layer(l, std::move(x), m, RunMode::kPlain);
      if (l + 1 < job_.layers.end) timer.watch(l, x);
    }
    cursor.layer = -1;
    {
      UserCodeScope user(c_.model.name, "the loss_fn");
      AutocastScope autocast(c_.record->autocast);
      loss_ = c_.loss_fn(x, label_);
    }
    std::vector<at::Tensor> roots = flatten_tensors(loss_);
    check_losses(loss_, roots);
    timer.start();
    torch::autograd::backward(roots);
    timer.finish(record_.layer_times);
    if (c_.keep_outputs) outputs_ = x;
    x_ = leaf_grads(leaves);  // handed on to the next job
  }

  void compute_backward(int64_t m) {
    const LayerRange& range = job_.layers;
    std::vector<at::Tensor> grads = tensors_from_ivalue(x_);
    if (c_.grain == RecomputeGrain::kStage) {
      auto [x, leaves] = make_leaves(saved_, saved_in_.value, range.begin);
      {
        at::AutoGradMode grad(true);
        BackwardTimer timer(dev_, range, m, times_layers(m));
        for (int64_t l = range.begin; l < range.end; ++l) {
          x = run_layer(l, std::move(x), m, RunMode::kRecompute);
          if (l + 1 < range.end) timer.watch(l, x);
        }
        timer.start();
        backward_outputs(x, grads);
        timer.finish(record_.layer_times);
      }
      x_ = leaf_grads(leaves);
    } else {
      x_ = backward_layer_by_layer(saved_, saved_in_.value, std::move(grads), m);
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
        // Layer l gets a copy of its kept input, which it may change in place.
        inputs.push_back(run_layer(l, clone_tensors(inputs.back()), m, RunMode::kRecompute));
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
        MarkPtr start = layer_mark(m);
        backward_outputs(y, grads);
        if (start) {
          record_.layer_times.push_back(
              LayerTimeRecord{LayerRange{l, l + 1}, LayerAction::kBackward, m, start, dev_.mark(Lane::kCompute)});
        }
      }
      input_grads = leaf_grads(leaves);
      grads = tensors_from_ivalue(input_grads);
    }
    return input_grads;
  }

  // Sums each parameter's gradient over the stage's layers (tied parameters
  // once, in layer order) and downloads it.
  void download_grads() {
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
    MarkPtr start = download_mark();
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

  // Buffers written by this stage's forward persist (recomputation's do
  // not): they are downloaded. A buffer no run wrote keeps the host tensor
  // it was uploaded from, so nothing downloads it or waits for it.
  void download_buffers() {
    MarkPtr start;
    int64_t bytes = 0;
    for (int64_t l = job_.layers.begin; l < job_.layers.end; ++l) {
      cursor.layer = l;
      const size_t i = static_cast<size_t>(l - job_.layers.begin);
      std::vector<at::Tensor> bufs = layer(l)->bound_buffers(dev_.index());
      if (bufs.empty()) continue;
      const std::vector<char> written = watches_.at(i).written(bufs);
      std::vector<at::Tensor> values = own_stage_.buffer_sources.at(i);
      std::vector<at::Tensor> changed;
      for (size_t b = 0; b < bufs.size(); ++b) {
        if (!written[b]) continue;
        changed.push_back(bufs[b]);
        if (bufs[b].defined()) bytes += static_cast<int64_t>(bufs[b].nbytes());
      }
      FencePtr downloaded;
      if (!changed.empty()) {
        if (!start) start = download_mark();
        std::vector<at::Tensor> host = dev_.download(changed);  // complete at the job's fences
        downloaded = dev_.lane_fence(Lane::kDownload);
        size_t next = 0;
        for (size_t b = 0; b < bufs.size(); ++b) {
          if (written[b]) values[b] = std::move(host[next++]);
        }
      }
      c_.buffers[j_].emplace_back(l, values);
      if (c_.buffer_out) c_.buffer_out->publish(l, std::move(values), std::move(downloaded));
    }
    cursor.layer = -1;
    if (bytes > 0) add_span(TraceLane::kDownload, Lane::kDownload, "download", "buffers", j_, -1, bytes, start);
  }

  Call& c_;
  size_t j_;
  const JobSpec& job_;
  const JobProgram& program_;
  Device& dev_;
  JobRecord& record_;
  std::vector<FencePtr> op_fences_;  // [op]: what the op issued is complete after this
  StageTensors own_stage_;           // this job's stage, once uploaded or taken over
  int64_t bound_until_ = 0;
  bool holds_slot_ = false;          // this job's stage slot is taken
  std::vector<std::vector<at::Tensor>> leaves_;  // [layer in stage][param]
  std::vector<BufferWatch> watches_;             // [layer in stage]: forward and fused jobs
  // The microbatch in flight between its upload, compute and hand-off.
  Slot in_;                   // its input slot as taken
  Slot saved_in_;             // a backward job's saved stage input slot
  c10::IValue x_;             // input on the device, then the result to hand on
  c10::IValue label_, saved_;  // the fused job's label; a backward job's saved input on the device
  c10::IValue loss_, outputs_;  // the fused job's, for the host
};

}  // namespace

void run_job(Call& c, size_t j, Device& device) {
  {
    // The layers' backward (autograd) runs inside the job too.
    UserCodeScope user(c.model.name, "a job (a layer's backward)");
    JobRunner runner(c, j, device);
    try {
      if (!c.failed()) runner.run();
    } catch (const Cancelled&) {
    } catch (...) {
      c.fail(std::current_exception(), describe(c, j, device, runner.cursor));
    }
    // The give-back: everything the job issued, on every lane: the call
    // waits for it, and the job's stage slot is reused only after it.
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
