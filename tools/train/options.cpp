#include "options.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace roundpipe {
namespace train {
namespace {

constexpr int64_t kMaxCount = 1000000000000;  // steps and other counts: 10^12

// An integer from `lo` to `hi`, checked on the text: CLI11's numeric checks
// parse as double, so an integer past int64 passed them and saturated, and
// their messages print a 300-digit bound.
CLI::Validator integer_in(int64_t lo, int64_t hi) {
  const std::string range = "an integer from " + std::to_string(lo) + " to " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, range](std::string& text) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long long v = std::strtoll(text.c_str(), &end, 10);
        const bool number = !text.empty() && end != nullptr && *end == '\0' && errno != ERANGE;
        if (!number || v < lo || v > hi) return "'" + text + "' is not " + range;
        return std::string();
      },
      "INT in [" + std::to_string(lo) + " - " + std::to_string(hi) + "]");
}

// A file this run will write: its directory must exist and take a new file
// (checked by making one), and the path must not be a directory. Checked
// before training, so a typo does not cost the run.
void check_output_path(const std::string& flag, const std::string& path) {
  auto fail = [&](const std::string& what) { throw InputError(flag + " " + path + ": " + what); };
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) fail("is a directory; give a file name");
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    fail("the directory '" + dir + "' does not exist; create it first");
  }
  const std::string probe = dir + "/.roundpipe-train-probe." + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) fail("cannot create a file in '" + dir + "': " + std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

// A directory this run will write into (--save-hf): an existing directory
// that takes a new file, or a new one whose parent exists.
void check_output_dir(const std::string& flag, const std::string& path) {
  auto fail = [&](const std::string& what) { throw InputError(flag + " " + path + ": " + what); };
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) fail("is not a directory; give a directory to write the model into");
    const std::string probe = path + "/.roundpipe-train-probe." + std::to_string(::getpid());
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) fail(std::string("cannot create a file in it: ") + std::strerror(errno));
    ::close(fd);
    ::unlink(probe.c_str());
    return;
  }
  std::string trimmed = path;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  check_output_path(flag, trimmed);  // its parent exists and takes a new entry
}

}  // namespace

void add_options(CLI::App& app, TrainOptions& o) {
  // A flag given twice takes its last value (so scripts can override defaults).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  const auto positive = integer_in(1, kMaxCount);
  const auto non_negative = integer_in(0, kMaxCount);

  auto* preset =
      app.add_option("--preset", o.preset, "model preset: llama or qwen3 (tiny, byte vocabulary)")
          ->check(CLI::IsMember({"llama", "qwen3"}))
          ->capture_default_str();
  auto* config = app.add_option("--config", o.config, "Hugging Face config.json (instead of --preset)")
                     ->check(CLI::ExistingFile)
                     ->excludes(preset);
  auto* weights = app.add_option("--weights", o.weights,
                                 "initial weights: safetensors file, sharded index (.json) or directory")
                      ->check(CLI::ExistingPath);
  app.add_option("--hf-model", o.hf_model,
                 "a Hugging Face checkpoint directory (config.json and safetensors weights): "
                 "the same as --config DIR/config.json --weights DIR")
      ->check(CLI::ExistingDirectory)
      ->excludes(preset)
      ->excludes(config)
      ->excludes(weights);
  app.add_option("--seq-len", o.seq_len, "tokens per sequence")
      ->check(integer_in(1, int64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--dtype", o.dtype,
                 "model dtype: fp32, bf16 or fp16 (bf16/fp16 keep fp32 optimizer copies unless "
                 "--optimizer-state compact; fp16 uses loss scaling)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();

  app.add_option("--data", o.data,
                 "pre-tokenized training data (.bin of uint16/uint32 ids; default: the embedded "
                 "corpus, byte-tokenized)")
      ->check(CLI::ExistingFile);
  app.add_option("--data-dtype", o.data_dtype,
                 "token type of --data/--eval-data: uint16 or uint32 (default: uint16 unless the "
                 "vocabulary exceeds 65536)")
      ->check(CLI::IsMember({"uint16", "uint32"}));
  app.add_option("--eval-data", o.eval_data,
                 "pre-tokenized evaluation data (default: hold out "
                 "--eval-fraction of the training data)")
      ->check(CLI::ExistingFile);
  app.add_option("--eval-fraction", o.eval_fraction,
                 "fraction of the training data held out for evaluation without --eval-data")
      ->check(CLI::Range(0.0, 0.5))
      ->capture_default_str();
  app.add_option("--eval-batches", o.eval_batches, "batches per evaluation (0: all held-out data)")
      ->check(non_negative)
      ->capture_default_str();
  app.add_option("--data-seed", o.data_seed, "seed of the shuffled data order")
      ->capture_default_str();

  app.add_option("--steps", o.steps, "optimizer steps of the whole schedule")
      ->check(positive)
      ->capture_default_str();
  app.add_option("--stop-after", o.stop_after,
                 "end this run after this step (the schedule still spans --steps; resume later)")
      ->check(non_negative);
  app.add_option("--batch-size", o.batch_size, "sequences per step")
      ->check(integer_in(1, int64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--microbatches", o.microbatches, "microbatches per step (default: devices + 1)")
      ->check(integer_in(0, int64_t{1} << 30));
  app.add_option("--devices", o.devices,
                 "device pool, as ROUNDPIPE_DEVICES: cpu:N, cuda, cuda:0,2 (default: the "
                 "environment's, else all GPUs, else cpu:1)");
  app.add_option("--threads", o.threads, "libtorch intra-op threads (default: libtorch's)")
      ->check(integer_in(0, 65536));

  app.add_option("--lr", o.lr, "peak learning rate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--min-lr", o.min_lr, "learning rate at the end of the cosine decay")
      ->check(non_negative)
      ->capture_default_str();
  app.add_option("--warmup-steps", o.warmup_steps,
                 "linear warm-up steps before the cosine decay (default: min(20, steps / 5))")
      ->check(non_negative);
  app.add_option("--weight-decay", o.weight_decay, "AdamW decoupled weight decay")
      ->check(non_negative)
      ->capture_default_str();
  app.add_option("--beta1", o.beta1, "AdamW beta1")
      ->check(CLI::Range(0.0, 0.999999))
      ->capture_default_str();
  app.add_option("--beta2", o.beta2, "AdamW beta2")
      ->check(CLI::Range(0.0, 0.999999))
      ->capture_default_str();
  app.add_option("--clip-grad-norm", o.clip_grad_norm,
                 "clip the global gradient norm to this value (0: off)")
      ->check(non_negative)
      ->capture_default_str();

  app.add_option("--optimizer-state", o.optimizer_state,
                 "fp32: fp32 optimizer copies and AdamW moments (18 B/parameter with a bf16 "
                 "model); compact: blockwise 8-bit moments and, for a bf16 model, bf16 "
                 "optimizer copies")
      ->check(CLI::IsMember({"fp32", "compact"}))
      ->capture_default_str();

  app.add_option("--eval-every", o.eval_every, "evaluate every N steps (0: only at the end)")
      ->check(non_negative)
      ->capture_default_str();
  app.add_option("--save-every", o.save_every,
                 "save a checkpoint every N steps (0: only at the end)")
      ->check(non_negative);
  app.add_option("--checkpoint", o.checkpoint,
                 "checkpoint file to write (\"{step}\" in the name is replaced by the step)");
  app.add_option("--resume", o.resume, "resume training from this checkpoint")
      ->check(CLI::ExistingFile);
  app.add_option("--lora-rank", o.lora_rank,
                 "train LoRA adapters of this rank, at most the hidden size (0: full training)")
      ->check(integer_in(0, int64_t{1} << 20));
  app.add_option("--lora-alpha", o.lora_alpha, "LoRA scaling numerator (scale = alpha / rank)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lora-targets", o.lora_targets, "comma-separated projections that get adapters")
      ->capture_default_str();
  app.add_option("--frozen-weights", o.frozen_weights,
                 "with --lora-rank: keep the frozen projection weights packed in host memory, "
                 "dequantized on the devices (nf4, fp4: 4-bit with double quantization; int8: "
                 "per-row scales); default: the model's dtype")
      ->check(CLI::IsMember({"nf4", "fp4", "int8"}));
  app.add_option("--trace", o.trace, "write a Chrome trace (Perfetto) of the run to this file");
  app.add_option("--metrics", o.metrics,
                 "write one JSON object per step and evaluation (JSON Lines)");
  app.add_option("--save-hf", o.save_hf,
                 "at the end, write the model into this directory as transformers' "
                 "save_pretrained does (config.json, safetensors; with --lora-rank also the PEFT "
                 "adapter)");
  app.add_option("--save-hf-shard-mb", o.save_hf_shard_mb,
                 "--save-hf: the largest safetensors file in MB (10^6 bytes); a larger model is "
                 "sharded")
      ->check(integer_in(1, kMaxCount))
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the model's initialization and random streams")
      ->capture_default_str();
  app.add_flag("--quiet,-q", o.quiet, "print only the start-up summary, warnings and the result");
  app.add_option("--log-every", o.log_every,
                 "progress line every N steps when stdout is not a terminal")
      ->check(positive)
      ->capture_default_str();
}

std::string checkpoint_path(const std::string& pattern, int64_t step) {
  std::string out = pattern;
  const std::string key = "{step}";
  for (size_t at = out.find(key); at != std::string::npos; at = out.find(key, at)) {
    out.replace(at, key.size(), std::to_string(step));
  }
  return out;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

void validate(TrainOptions& o) {
  auto fail = [](const std::string& what) { throw InputError(what); };
  if (!o.hf_model.empty()) {
    const std::string dir = o.hf_model.back() == '/' ? o.hf_model : o.hf_model + "/";
    if (!std::ifstream(dir + "config.json")) {
      fail("--hf-model " + o.hf_model + ": no config.json in the directory (a Hugging Face checkpoint "
           "directory holds config.json and *.safetensors)");
    }
    o.config = dir + "config.json";
    o.weights = o.hf_model;
  }
  if (o.min_lr > o.lr)
    fail("--min-lr (" + std::to_string(o.min_lr) + ") must not exceed --lr (" +
         std::to_string(o.lr) + ")");
  if (o.warmup_steps < 0) o.warmup_steps = std::min<int64_t>(20, o.steps / 5);
  if (o.warmup_steps >= o.steps && o.steps > 1) {
    fail("--warmup-steps (" + std::to_string(o.warmup_steps) + ") must be below --steps (" +
         std::to_string(o.steps) + ")");
  }
  if (o.stop_after > o.steps) fail("--stop-after must not exceed --steps");
  if (o.microbatches > o.batch_size) {
    fail("--microbatches (" + std::to_string(o.microbatches) + ") must not exceed --batch-size (" +
         std::to_string(o.batch_size) + "): each microbatch needs at least one sequence");
  }
  if (o.optimizer_state == "compact" && o.dtype == "fp16") {
    // fp16 copies would lose small updates (no stochastic rounding for fp16),
    // and fp16 loss scaling unscales into fp32 copies.
    fail("--optimizer-state compact is not supported with --dtype fp16: use --dtype bf16 (bf16 "
         "optimizer copies) or keep --optimizer-state fp32");
  }
  if (o.save_every > 0 && o.checkpoint.empty()) fail("--save-every needs --checkpoint PATH");
  if (o.lora_rank > 0 && split_list(o.lora_targets).empty()) fail("--lora-targets lists no module");
  if (!o.frozen_weights.empty() && o.lora_rank == 0) {
    // Full training updates every weight: none is frozen, so none can be packed.
    fail("--frozen-weights " + o.frozen_weights +
         " packs the frozen weights of a LoRA run, but without --lora-rank every weight is "
         "trained: add --lora-rank R (e.g. --lora-rank 8), or drop --frozen-weights");
  }
  // Every file the run writes, before it starts ("{step}" as at step 0).
  if (!o.checkpoint.empty()) check_output_path("--checkpoint", checkpoint_path(o.checkpoint, 0));
  if (!o.trace.empty()) check_output_path("--trace", o.trace);
  if (!o.metrics.empty()) check_output_path("--metrics", o.metrics);
  if (!o.save_hf.empty()) check_output_dir("--save-hf", o.save_hf);
  if (!std::isfinite(o.lr) || !std::isfinite(o.min_lr) || !std::isfinite(o.weight_decay) ||
      !std::isfinite(o.clip_grad_norm)) {
    fail("learning rates, weight decay and the clipping norm must be finite");
  }
}

}  // namespace train
}  // namespace roundpipe
