// --save-hf of roundpipe-train: the trained model in the Hugging Face layout
// (docs/train.md, "Evaluation, checkpoints, outputs"), which
// transformers.AutoModelForCausalLM.from_pretrained loads, and for a LoRA run
// the adapter as PEFT's save_pretrained writes it.
#pragma once

#include <roundpipe/lora.h>
#include <roundpipe/presets.h>

#include <cstdint>
#include <string>

namespace roundpipe {
namespace train {

struct HfExport {
  std::string dir;
  // The shards' size limit (transformers' max_shard_size): one
  // model.safetensors up to it, else model-0000i-of-0000n.safetensors shards
  // and model.safetensors.index.json.
  uint64_t max_shard_bytes = 0;
  // The config.json the run was built from; empty: made from the config.
  std::string source_config;
  std::string dtype;  // fp32 | bf16 | fp16
  // rank 0: full training. Otherwise config.json and the weights hold the
  // (frozen) base model, and adapter_config.json + adapter_model.safetensors
  // the adapters, with base_model_name_or_path naming `dir` itself.
  LoraConfig lora;
  int64_t lora_rank = 0;
};

// Writes `net` (made by make_decoder(config), trained in place) into
// e.dir, created when missing (its parent must exist: checked up front by
// validate()). Files of an earlier export in another layout (shards, index,
// adapter) are removed, so from_pretrained reads only this one. Returns a
// one-line description of what was written. Throws c10::Error when a file
// cannot be written.
std::string save_hf(const torch::nn::Sequential& net, const DecoderConfig& config,
                    const HfExport& e);

}  // namespace train
}  // namespace roundpipe
