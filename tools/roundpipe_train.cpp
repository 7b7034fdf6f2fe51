// roundpipe-train: trains a Llama or Qwen3 decoder with RoundPipe, the main
// job of the project. With no arguments it trains the tiny Llama preset on
// the embedded corpus (byte-tokenized) and prints a progress line, periodic
// evaluation losses and a summary. docs/train.md describes every flag.
//
//   roundpipe-train                                   # embedded default
//   roundpipe-train --preset qwen3 --devices cpu:4 --dtype bf16 --steps 1000
//   roundpipe-train --config cfg.json --weights model.safetensors --data train.bin
//   roundpipe-train --checkpoint run.ckpt --save-every 100 ...; later --resume run.ckpt
//   roundpipe-train --hf-model DIR --data train.bin --save-hf OUT   # from_pretrained(OUT) loads it
//
// The training loop, top to bottom (run()):
//   model: preset/config -> make_decoder -> weights -> dtype -> RoundPipe
//   optimizer: roundpipe::optim::AdamW over the optimizer copies (fp32; with
//             --optimizer-state compact 8-bit moments and, for bf16, bf16 copies)
//   per step: next batch -> forward_backward (loss on the devices) ->
//             step(step_fn) queued on the optimizer thread: lr of this step,
//             [unscale], global norm + clipping, AdamW step, zero_grad.
//   The optimizer runs one step behind (RoundPipe::step), so the gradient norm of
//   step k is known when step k + 1 is issued: per-step records are written
//   to --metrics once it is.
//
// Exit status: 0 on success, 2 for bad input (a message says what to change),
// 1 for anything else.
#include <roundpipe/checkpoint.h>
#include <roundpipe/grad_scaler.h>
#include <roundpipe/lora.h>
#include <roundpipe/model.h>
#include <roundpipe/optim/adam.h>
#include <roundpipe/packed_linear.h>
#include <roundpipe/presets.h>
#include <roundpipe/token_data.h>
#include <roundpipe/trace.h>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "train/data.h"
#include "train/export.h"
#include "train/lr_schedule.h"
#include "train/metrics.h"
#include "train/options.h"
#include "train/progress.h"
#include "train/weights.h"

using namespace roundpipe;
using namespace roundpipe::train;
using json = nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;

// Ctrl-C (SIGINT): the run stops at the next step boundary, writes its
// checkpoint and exits 130; a second Ctrl-C ends the process at once.
volatile std::sig_atomic_t g_interrupted = 0;

extern "C" void on_sigint(int) {
  g_interrupted = 1;
  std::signal(SIGINT, SIG_DFL);
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

[[noreturn]] void fail(const std::string& what) { throw InputError(what); }

at::ScalarType model_dtype(const std::string& name) {
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  return at::kFloat;
}

DecoderConfig model_config(const TrainOptions& o, std::string* source) {
  if (!o.config.empty()) {
    *source = o.config;
    return load_hf_config(o.config);
  }
  *source = "preset tiny_" + o.preset;
  return o.preset == "qwen3" ? tiny_qwen3_config() : tiny_llama_config();
}

// Distinct tensors (tied weights once).
int64_t count_elements(const std::vector<at::Tensor>& tensors) {
  std::set<const void*> seen;
  int64_t n = 0;
  for (const at::Tensor& t : tensors) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) n += t.numel();
  }
  return n;
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

// Gradient norms measured on the optimizer thread, read on the main thread.
class NormLog {
 public:
  void put(int64_t step, double norm) {
    std::lock_guard<std::mutex> lock(mu_);
    norms_[step] = norm;
  }
  bool take(int64_t step, double* norm) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = norms_.find(step);
    if (it == norms_.end()) return false;
    *norm = it->second;
    norms_.erase(it);
    return true;
  }

 private:
  std::mutex mu_;
  std::map<int64_t, double> norms_;  // guarded by mu_
};

// The global L2 norm of the gradients of `params` (the optimizer copies,
// fp32 or bf16); when max_norm > 0 and the norm exceeds it, scales them down
// to max_norm (as torch.nn.utils.clip_grad_norm_). Runs on the optimizer thread.
double clip_gradients(const std::vector<at::Tensor>& params, double max_norm) {
  std::vector<at::Tensor> norms;
  for (const at::Tensor& p : params) {
    // Accumulated and returned in fp32 whatever the gradient's dtype: a bf16
    // result would carry only 3 significant digits into the clipping factor.
    if (p.grad().defined()) {
      norms.push_back(
          at::linalg_vector_norm(p.grad(), 2, std::nullopt, false, at::kFloat).to(at::kDouble));
    }
  }
  if (norms.empty()) return 0.0;
  const double total = at::stack(norms).norm(2).item<double>();
  if (max_norm > 0 && std::isfinite(total) && total > max_norm) {
    const double factor = max_norm / (total + 1e-6);
    for (const at::Tensor& p : params) {
      if (p.grad().defined()) p.grad().mul_(factor);
    }
  }
  return total;
}

// The largest count <= m that divides n (so evaluation microbatches are equal
// and the merged mean loss is exact).
int64_t even_split(int64_t n, int64_t m) {
  for (int64_t k = std::min(n, m); k > 1; --k) {
    if (n % k == 0) return k;
  }
  return 1;
}

// Mean loss over the evaluation batches, under no-grad forward, with the
// parameters the devices see now (after the optimizer step before the last).
double evaluate(RoundPipe& model, const std::vector<TokenBatch>& batches, int64_t microbatches) {
  torch::NoGradGuard no_grad;
  double sum = 0;
  int64_t rows = 0;
  for (const TokenBatch& b : batches) {
    const int64_t n = b.input_ids.size(0);
    RunConfig cfg = RunConfig().num_microbatch(even_split(n, microbatches));
    at::Tensor loss =
        model.forward({b.input_ids}, make_kwargs({{"labels", b.labels}}), cfg).toTensor();
    sum += loss.item<double>() * n;
    rows += n;
  }
  return rows > 0 ? sum / rows : std::nan("");
}

// The device pool, fixed by this first use; a bad --devices spec is named as
// the flag, not as the environment variable it is passed through.
std::vector<std::string> device_pool(const TrainOptions& o) {
  try {
    return get_device_names();
  } catch (const c10::ValueError& e) {
    if (o.devices.empty()) throw;
    std::string what = e.what_without_backtrace();
    const std::string env = "ROUNDPIPE_DEVICES='" + o.devices + "'";
    for (size_t at = what.find(env); at != std::string::npos; at = what.find(env, at)) {
      what.replace(at, env.size(), "--devices " + o.devices);
    }
    throw InputError(what);
  }
}

json memory_json(const std::vector<DeviceMemoryStats>& stats) {
  json out = json::object();
  for (const auto& d : stats) out[d.device] = d.max_allocated_bytes;
  return out;
}

int run(const TrainOptions& o) {
  const auto start = Clock::now();
  // The pool is fixed at its first use: the spec must be in place before.
  if (!o.devices.empty()) setenv("ROUNDPIPE_DEVICES", o.devices.c_str(), 1);
  if (o.threads > 0) at::set_num_threads(static_cast<int>(o.threads));
  // Keep freed blocks in the process: otherwise large tensors are faulted in
  // afresh every iteration (DESIGN 5).
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, -1);

  // ---- Model ----
  std::string source;
  const DecoderConfig cfg = model_config(o, &source);
  if (o.seq_len > cfg.max_position_embeddings) {
    fail("--seq-len " + std::to_string(o.seq_len) +
         " exceeds the model's max_position_embeddings (" +
         std::to_string(cfg.max_position_embeddings) + ")");
  }
  const at::ScalarType dtype = model_dtype(o.dtype);
  const std::vector<std::string> devices = device_pool(o);  // fixes the pool
  if (dtype == at::kHalf) {
    for (const std::string& d : devices) {
      if (d.rfind("cpu", 0) == 0) {
        fail(
            "--dtype fp16 needs accelerator devices (CPU kernels lack fp16); use --dtype bf16 "
            "on CPU devices");
      }
    }
  }
  const int64_t microbatches =
      o.microbatches > 0 ? o.microbatches : static_cast<int64_t>(devices.size()) + 1;
  if (microbatches > o.batch_size) {
    fail("--batch-size " + std::to_string(o.batch_size) + " is smaller than the " +
         std::to_string(microbatches) +
         " microbatches (devices + 1): raise --batch-size or set --microbatches");
  }

  torch::manual_seed(o.seed);
  torch::nn::Sequential net = make_decoder(cfg);
  std::string weights_note = "random init (seed " + std::to_string(o.seed) + ")";
  if (!o.weights.empty()) {
    int64_t unused = 0;
    const int64_t n = load_hf_weights(net, cfg, o.weights, &unused);
    weights_note = std::to_string(n) + " tensors from " + o.weights +
                   (unused ? " (" + std::to_string(unused) + " unused)" : std::string());
  }
  if (dtype != at::kFloat) net->to(dtype);
  if (o.lora_rank > cfg.hidden_size) {
    fail("--lora-rank " + std::to_string(o.lora_rank) + " is out of range: from 1 to the hidden size (" +
         std::to_string(cfg.hidden_size) + ")");
  }
  if (o.lora_rank > 0) {
    LoraConfig lora;
    lora.rank = o.lora_rank;
    lora.alpha = o.lora_alpha;
    lora.target_modules = split_list(o.lora_targets);
    lora.frozen_weights = o.frozen_weights;
    const int64_t adapted = apply_lora(net, lora);  // freezes everything else, packs if asked
    weights_note += "; LoRA rank " + std::to_string(o.lora_rank) + ", alpha " +
                    c10::str(o.lora_alpha) + " on " + o.lora_targets + " (" +
                    std::to_string(adapted) + " projections)";
    if (!o.frozen_weights.empty()) {
      const int64_t bytes = packed_weight_bytes(net);
      const int64_t elements = packed_weight_elements(net);
      char per[32];
      std::snprintf(per, sizeof per, "%.3f", double(bytes) / double(elements));
      weights_note += "; frozen projection weights " + o.frozen_weights + ": " +
                      human_bytes(bytes) + " in host memory (" + per + " B/weight; " +
                      human_bytes(elements * int64_t(c10::elementSize(dtype))) + " in " + o.dtype +
                      ")";
    }
  }

  const bool compact = o.optimizer_state == "compact";
  RoundPipeOptions mo;
  mo.set_name("train").set_seed(o.seed).set_run_config(RunConfig().num_microbatch(microbatches));
  // Optimizer copies: fp32 for a bf16/fp16 model, except that the compact
  // state keeps a bf16 model's copies in bf16 (validate() refuses fp16).
  const at::ScalarType optim_dtype = compact ? dtype : at::kFloat;
  if (dtype != at::kFloat) mo.set_optim_dtype(optim_dtype);
  RoundPipe model(net, mo);

  const std::vector<at::Tensor> optim_params = model.optim_parameters();
  const optim::StateDtype state_dtype =
      compact ? optim::StateDtype::kBlockwise8 : optim::StateDtype::kFloat32;
  optim::AdamWOptions adamw_options(o.lr);
  adamw_options.betas(std::make_tuple(o.beta1, o.beta2))
      .weight_decay(o.weight_decay)
      .state_dtype(state_dtype);
  optim::AdamW optimizer(optim_params, adamw_options);
  std::unique_ptr<GradScaler> scaler;
  if (dtype == at::kHalf) scaler = std::make_unique<GradScaler>();
  GradScaler* const sc = scaler.get();

  // ---- Data ----
  DataOptions dopt;
  dopt.path = o.data;
  dopt.dtype = o.data_dtype;
  dopt.eval_path = o.eval_data;
  dopt.eval_fraction = o.eval_fraction;
  dopt.vocab_size = cfg.vocab_size;
  dopt.seq_len = o.seq_len;
  dopt.seed = o.data_seed;
  dopt.eval_batch_size = o.batch_size;
  dopt.max_eval_batches = o.eval_batches;
  TrainData data = make_train_data(dopt);

  // ---- Resume ----
  // What a checkpoint records of this run, to check a resume against.
  const json run_config = {{"format", "roundpipe-train-1"},
                           {"model_type", cfg.model_type},
                           {"config", source},
                           {"dtype", o.dtype},
                           {"optimizer_state", o.optimizer_state},
                           {"seq_len", o.seq_len},
                           {"batch_size", o.batch_size},
                           {"steps", o.steps},
                           {"lora_rank", o.lora_rank},
                           {"frozen_weights", o.frozen_weights.empty() ? "none" : o.frozen_weights}};
  int64_t start_step = 0;
  std::string resume_note;
  if (!o.resume.empty()) {
    CheckpointState state;
    state.optimizer = &optimizer;
    state.scaler = sc;
    try {
      load_checkpoint(o.resume, model, state);
    } catch (const c10::ValueError& e) {
      if (o.lora_rank == 0) throw;
      // Packed and unpacked weights have other names: say which flags must match.
      throw InputError(std::string(e.what_without_backtrace()) +
                       "; a LoRA checkpoint resumes with its run's --lora-rank, --lora-targets and "
                       "--frozen-weights (this run: --frozen-weights " +
                       (o.frozen_weights.empty() ? std::string("none") : o.frozen_weights) + ")");
    }
    start_step = state.step;
    data.train->seek(DataPosition::from_state(state.extra_state));
    resume_note = "resumed from " + o.resume + " at step " + std::to_string(start_step);
    const json saved = json::parse(state.metadata_json, nullptr, /*allow_exceptions=*/false);
    if (saved.is_object()) {
      for (const auto& item : run_config.items()) {
        if (saved.contains(item.key()) && saved[item.key()] != item.value()) {
          resume_note += "; note: the checkpoint's run had " + item.key() + " " +
                         saved[item.key()].dump() + ", this one " + item.value().dump();
        }
      }
    }
  }
  const int64_t last_step = o.stop_after > 0 ? o.stop_after : o.steps;
  if (start_step >= last_step) {
    fail("the checkpoint is at step " + std::to_string(start_step) + ": nothing to do up to step " +
         std::to_string(last_step) + " (raise --steps)");
  }

  LrSchedule schedule{o.lr, o.min_lr, o.warmup_steps, o.steps};
  const int64_t tokens_per_step = o.batch_size * o.seq_len;

  // ---- Start-up log ----
  // Packed weights are buffers now, yet parameters of the model all the same.
  const int64_t total_params = count_elements(net->parameters()) + packed_weight_elements(net);
  const int64_t trained_params = count_elements(optim_params);
  std::printf(
      "roundpipe-train: %s, %lld layers, hidden %lld, %lld heads (%lld kv), vocab %lld: "
      "%.2fM parameters (%.2fM trained), %s, %s\n",
      cfg.model_type.c_str(), (long long)cfg.num_hidden_layers, (long long)cfg.hidden_size,
      (long long)cfg.num_attention_heads, (long long)cfg.kv_heads(), (long long)cfg.vocab_size,
      total_params / 1e6, trained_params / 1e6, o.dtype.c_str(), source.c_str());
  std::printf("  weights  %s\n", weights_note.c_str());
  std::printf("  data     %s\n", data.description.c_str());
  std::printf("  devices  %s; batch %lld x %lld tokens in %lld microbatches (%lld tokens/step)\n",
              join(devices, ", ").c_str(), (long long)o.batch_size, (long long)o.seq_len,
              (long long)microbatches, (long long)tokens_per_step);
  std::printf("  plan     %s (%lld layers; re-planned from measured times)\n",
              model.default_execute_plan(RunKind::kFused).to_string().c_str(),
              (long long)model.num_layers());
  char clip_text[32] = "off";
  if (o.clip_grad_norm > 0) std::snprintf(clip_text, sizeof clip_text, "%g", o.clip_grad_norm);
  std::printf(
      "  optim    AdamW lr %g -> %g (%lld warm-up steps, cosine), betas (%g, %g), weight "
      "decay %g, clip %s; optimizer one step behind%s\n",
      o.lr, o.min_lr, (long long)o.warmup_steps, o.beta1, o.beta2, o.weight_decay, clip_text,
      sc ? ", fp16 loss scaling" : "");
  std::printf("  state    %s: %s optimizer copies, %s AdamW moments", o.optimizer_state.c_str(),
              optim_dtype == at::kBFloat16 ? "bf16" : "fp32", compact ? "blockwise 8-bit" : "fp32");
  if (compact) {
    std::printf(" (fp32 for tensors under %lld elements)", (long long)optim::kMinBlockwise8Numel);
  }
  std::printf("\n");
  const std::string eval_when =
      data.eval.empty()  ? std::string("no evaluation data")
      : o.eval_every > 0 ? "eval every " + std::to_string(o.eval_every) + " and at the end"
                         : std::string("eval at the end");
  std::printf("  steps    %lld to %lld of %lld; %s%s%s\n", (long long)start_step + 1,
              (long long)last_step, (long long)o.steps, eval_when.c_str(),
              resume_note.empty() ? "" : "; ", resume_note.c_str());
  std::fflush(stdout);

  MetricsWriter metrics(o.metrics);
  Progress progress(stdout, o.quiet, o.log_every);
  if (!o.trace.empty()) start_trace(o.trace);

  const double batch = static_cast<double>(o.batch_size);
  // Each microbatch's mean loss weighted by its share of the batch: the sum
  // over microbatches is the batch's mean token loss.
  LossFn loss_fn = [sc, batch](const c10::IValue& out, const c10::IValue& label) -> c10::IValue {
    at::Tensor loss = out.toTensor() * (static_cast<double>(label.toTensor().size(0)) / batch);
    return sc ? c10::IValue(sc->scale(loss)) : c10::IValue(loss);
  };

  auto norms = std::make_shared<NormLog>();
  // Records wait here, in order, until the gradient norm of their step is known.
  struct Pending {
    int64_t step;  // 0: an evaluation record, ready as is
    json record;
  };
  std::deque<Pending> pending;
  auto flush = [&] {
    while (!pending.empty()) {
      Pending& p = pending.front();
      if (p.step > 0) {
        double norm = 0;
        if (!norms->take(p.step, &norm)) break;
        p.record["grad_norm"] = finite_or_null(norm);
      }
      metrics.write(p.record);
      pending.pop_front();
    }
  };
  auto run_eval = [&](int64_t step) {
    if (data.eval.empty()) return std::nan("");
    const double loss = evaluate(model, data.eval, microbatches);
    char buf[96];
    std::snprintf(buf, sizeof buf, "eval at step %lld: loss %.4f", (long long)step, loss);
    progress.note(buf);  // --quiet: the summary line reports the last evaluation
    pending.push_back({0, json{{"type", "eval"},
                               {"step", step},
                               {"eval_loss", finite_or_null(loss)},
                               {"elapsed_s", seconds_since(start)}}});
    flush();
    return loss;
  };
  // A mid-run save that fails (a full disk) costs that checkpoint, not the
  // run: the previous one stays, training goes on, the next save tries
  // again. The last save's failure is the run's error.
  auto save = [&](int64_t step, bool last) {
    CheckpointState state;
    state.optimizer = &optimizer;
    state.scaler = sc;
    state.step = step;
    state.extra_state = data.train->position().to_state();
    state.metadata_json = run_config.dump();
    const std::string path = checkpoint_path(o.checkpoint, step);
    try {
      save_checkpoint(path, model, state);  // waits for the step in flight; the trajectory is unchanged
    } catch (const c10::Error& e) {
      if (last) throw;
      progress.message(std::string("warning: the checkpoint of step ") + std::to_string(step) +
                       " was not written (" + e.what_without_backtrace() + "); training goes on");
      return;
    }
    flush();
    progress.note("checkpoint of step " + std::to_string(step) + " written to " + path);
  };

  std::deque<double> recent;  // seconds of the last steps, for tokens/s and ETA
  double first_loss = std::nan(""), last_loss = std::nan("");
  std::deque<double> last_losses;
  double eval_loss = std::nan("");
  const auto train_start = Clock::now();
  reset_peak_device_memory();
  std::vector<DeviceMemoryStats> peak = device_memory_stats();
  for (int64_t step = start_step + 1; step <= last_step; ++step) {
    const auto t0 = Clock::now();
    TokenBatch b = data.train->next_batch(o.batch_size);
    at::Tensor summed =
        model
            .forward_backward({b.input_ids}, make_kwargs({{"labels", b.labels}}), b.labels, loss_fn)
            .toTensor();
    const double loss = summed.item<double>() / (sc ? sc->get_scale() : 1.0);
    const std::vector<DeviceMemoryStats> mem = device_memory_stats();
    reset_peak_device_memory();
    for (size_t i = 0; i < mem.size() && i < peak.size(); ++i) {
      peak[i].max_allocated_bytes =
          std::max(peak[i].max_allocated_bytes, mem[i].max_allocated_bytes);
    }

    const double lr = schedule.at(step);
    const double clip = o.clip_grad_norm;
    model.step([&optimizer, &optim_params, norms, sc, lr, clip, step] {
      for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
      if (sc) sc->unscale_(optimizer);
      norms->put(step, clip_gradients(optim_params, clip));
      if (sc) {
        sc->step(optimizer);
      } else {
        optimizer.step();
      }
      optimizer.zero_grad();
    });
    if (sc) sc->update();

    const double secs = seconds_since(t0);
    recent.push_back(secs);
    if (recent.size() > 20) recent.pop_front();
    double window = 0;
    for (double s : recent) window += s;
    const double step_s = window / recent.size();
    if (step == start_step + 1) first_loss = loss;
    last_loss = loss;
    last_losses.push_back(loss);
    if (last_losses.size() > 10) last_losses.pop_front();

    pending.push_back({step, json{{"type", "train"},
                                  {"step", step},
                                  {"loss", finite_or_null(loss)},
                                  {"lr", lr},
                                  {"tokens_per_s", tokens_per_step / secs},
                                  {"peak_memory_bytes", memory_json(mem)},
                                  {"elapsed_s", seconds_since(start)}}});
    flush();

    ProgressLine line;
    line.step = step;
    line.total = last_step;
    line.loss = loss;
    line.tokens_per_s = tokens_per_step / step_s;
    line.eta_s = step_s * (last_step - step);
    for (const auto& d : mem) line.peak_memory.emplace_back(d.device, d.max_allocated_bytes);
    progress.update(line);
    if (!std::isfinite(loss)) {
      progress.message("warning: the loss of step " + std::to_string(step) + " is not finite");
    }

    if (g_interrupted) {
      progress.finish();
      std::printf("interrupted: stopping after step %lld of %lld\n", (long long)step, (long long)last_step);
      if (!o.checkpoint.empty()) save(step, true);  // resumable from here, as a mid-run checkpoint
      model.synchronize();
      flush();
      return 130;
    }
    if (o.eval_every > 0 && step % o.eval_every == 0 && step != last_step) run_eval(step);
    if (o.save_every > 0 && step % o.save_every == 0 && step != last_step) save(step, false);
  }
  // Saved before synchronize(), which publishes the last step into the
  // masters: the checkpoint keeps the one-step delay, as mid-run ones do, so
  // a resumed run continues exactly as this one would have.
  if (!o.checkpoint.empty()) save(last_step, true);
  model.synchronize();
  flush();
  const double train_s = seconds_since(train_start);
  progress.finish();
  eval_loss = run_eval(last_step);
  flush();
  if (!o.save_hf.empty()) {
    HfExport e;
    e.dir = o.save_hf;
    e.max_shard_bytes = static_cast<uint64_t>(o.save_hf_shard_mb) * 1000000;
    e.source_config = o.config;
    e.dtype = o.dtype;
    e.lora_rank = o.lora_rank;
    e.lora.alpha = o.lora_alpha;
    e.lora.target_modules = split_list(o.lora_targets);
    progress.message(save_hf(net, cfg, e));
  }
  if (!o.trace.empty()) {
    stop_trace();
    std::printf("trace written to %s\n", o.trace.c_str());
  }

  double tail = 0;
  for (double l : last_losses) tail += l;
  tail /= std::max<size_t>(last_losses.size(), 1);
  const int64_t steps_run = last_step - start_step;
  std::printf(
      "done: %lld steps in %s (%s tokens/s); loss %.4f at step %lld -> %.4f (mean of last "
      "%zu: %.4f)",
      (long long)steps_run, human_duration(train_s).c_str(),
      human_count(steps_run * tokens_per_step / train_s).c_str(), first_loss,
      (long long)start_step + 1, last_loss, last_losses.size(), tail);
  if (std::isfinite(eval_loss)) std::printf("; eval loss %.4f", eval_loss);
  std::printf("\n  peak memory");
  for (const auto& d : peak)
    std::printf("  %s %s", d.device.c_str(), human_bytes(d.max_allocated_bytes).c_str());
  std::printf("\n  final plan %s\n",
              model.default_execute_plan(RunKind::kFused).to_string().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "roundpipe-train: trains a Llama or Qwen3 decoder with RoundPipe (host-resident model, "
      "round-robin device pool, asynchronous CPU optimizer). Without arguments: the tiny Llama "
      "preset on the embedded corpus."};
  TrainOptions options;
  add_options(app, options);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  try {
    validate(options);
    std::signal(SIGINT, on_sigint);
    return run(options);
  } catch (const InputError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "roundpipe-train: %s\n", e.what());
    return 2;
  } catch (const c10::ValueError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "roundpipe-train: %s\n", e.what_without_backtrace());
    return 2;
  } catch (const c10::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "roundpipe-train: error: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "roundpipe-train: error: %s\n", e.what());
    return 1;
  }
}
