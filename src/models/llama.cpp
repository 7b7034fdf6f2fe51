// The Llama / Qwen3 decoder presets: assembling the layers, Hugging Face
// parameter names, and the loss function for forward_backward.
#include <torch/nn/modules/container/sequential.h>

#include <string>
#include <unordered_set>

#include "roundpipe/presets.h"

namespace roundpipe {

torch::nn::Sequential make_decoder(const DecoderConfig& config) {
  config.validate();
  torch::nn::Sequential seq;
  DecoderEmbedding embedding(config);
  seq->push_back(embedding);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) seq->push_back(DecoderBlock(config));
  seq->push_back(
      LmHead(config, config.tie_word_embeddings ? embedding->embed_tokens->weight : at::Tensor()));
  return seq;
}

std::vector<std::pair<std::string, std::string>> hf_parameter_names(const DecoderConfig& config) {
  // Names only: build the structure without drawing random numbers.
  DecoderConfig c = config;
  c.initializer_range = 0.0;
  torch::nn::Sequential seq = make_decoder(c);
  const std::string head = std::to_string(config.num_hidden_layers + 1);
  std::vector<std::pair<std::string, std::string>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : seq->named_parameters()) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // a tied alias
    const std::string& name = item.key();
    const size_t dot = name.find('.');
    const std::string layer = name.substr(0, dot), rest = name.substr(dot + 1);
    if (layer == "0") {
      out.emplace_back(name, "model." + rest);
    } else if (layer == head) {
      out.emplace_back(name, rest == "norm.weight" ? "model.norm.weight" : rest);
    } else {
      out.emplace_back(name, "model.layers." + std::to_string(std::stoll(layer) - 1) + "." + rest);
    }
  }
  return out;
}

LossFn preset_loss_fn() {
  return [](const c10::IValue& outputs, const c10::IValue& label) -> c10::IValue {
    TORCH_CHECK_VALUE(
        outputs.isTensor() && outputs.toTensor().dim() == 0,
        "preset_loss_fn: the head returned logits, not a loss; call the model with labels");
    return outputs;
  };
}

}  // namespace roundpipe
