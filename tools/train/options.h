// The command line of roundpipe-train: every flag, its default, and the
// checks that CLI11 cannot express (docs/train.md describes them for users).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace roundpipe {
namespace train {

// Bad input: reported as is, exit status 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TrainOptions {
  // Model.
  std::string preset = "llama";  // llama | qwen3 (tiny presets)
  std::string config;            // a Hugging Face config.json instead of the preset
  std::string weights;           // safetensors file, sharded index or directory
  std::string hf_model;          // a Hugging Face checkpoint directory: --config DIR/config.json --weights DIR
  int64_t seq_len = 64;
  std::string dtype = "fp32";  // fp32 | bf16 | fp16
  // Data.
  std::string data;        // pre-tokenized .bin; empty: the embedded corpus
  std::string data_dtype;  // uint16 | uint32; empty: by vocabulary size
  std::string eval_data;
  double eval_fraction = 0.05;  // held out when there is no --eval-data
  int64_t eval_batches = 4;     // batches per evaluation (0: all)
  uint64_t data_seed = 0;
  // Schedule.
  int64_t steps = 250;
  int64_t stop_after = 0;  // end this run after this step (0: at --steps)
  int64_t batch_size = 16;
  int64_t microbatches = 0;  // 0: devices + 1
  std::string devices;       // ROUNDPIPE_DEVICES spec
  int64_t threads = 0;       // intra-op threads (0: libtorch's default)
  // Optimizer.
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = -1;  // -1: min(20, steps / 5)
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double clip_grad_norm = 1.0;  // 0: off
  // fp32 | compact: compact keeps the AdamW moments in blockwise 8-bit form
  // and, for a bf16 model, the optimizer copies in bf16 (docs/train.md).
  std::string optimizer_state = "fp32";
  // Evaluation, checkpoints, outputs.
  int64_t eval_every = 100;  // 0: only at the end
  int64_t save_every = 0;    // 0: only at the end (when --checkpoint is given)
  std::string checkpoint;
  std::string resume;
  int64_t lora_rank = 0;  // 0: full fine-tuning
  double lora_alpha = 16.0;
  std::string lora_targets = "q_proj,v_proj";
  std::string frozen_weights;  // "" | nf4 | fp4 | int8: the frozen weights packed (LoRA only)
  std::string trace;
  std::string metrics;
  std::string save_hf;              // a Hugging Face model directory written at the end
  int64_t save_hf_shard_mb = 50000;  // shard size limit (transformers' default 50GB)
  uint64_t seed = 0;
  bool quiet = false;
  int64_t log_every = 10;  // progress lines when stdout is not a terminal
};

// Registers every flag of `o` on `app` (with CLI11 range/enum checks).
void add_options(CLI::App& app, TrainOptions& o);
// Checks across flags, and that every output path (--checkpoint, --trace,
// --metrics, --save-hf) can be written; resolves defaults that depend on
// other flags; throws InputError saying what to change.
void validate(TrainOptions& o);
// The --checkpoint file of `step` ("{step}" in `pattern` replaced by it).
std::string checkpoint_path(const std::string& pattern, int64_t step);
// "a,b" -> {"a", "b"} (empty items dropped).
std::vector<std::string> split_list(const std::string& text);

}  // namespace train
}  // namespace roundpipe
