// LoRA for the presets: validation, adding the adapters, freezing the rest.
#include "roundpipe/lora.h"

#include <cmath>
#include <set>
#include <string>

#include "roundpipe/packed_linear.h"
#include "roundpipe/presets.h"

namespace roundpipe {
namespace {

const std::set<std::string>& known_modules() {
  static const std::set<std::string> names = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                              "gate_proj", "up_proj", "down_proj"};
  return names;
}

// The projection `name` of a block.
Projection projection_of(const DecoderBlockImpl& block, const std::string& name) {
  if (name == "q_proj") return block.self_attn->q_proj;
  if (name == "k_proj") return block.self_attn->k_proj;
  if (name == "v_proj") return block.self_attn->v_proj;
  if (name == "o_proj") return block.self_attn->o_proj;
  if (name == "gate_proj") return block.mlp->gate_proj;
  if (name == "up_proj") return block.mlp->up_proj;
  TORCH_INTERNAL_ASSERT(name == "down_proj", "unknown projection ", name);
  return block.mlp->down_proj;
}

bool is_adapter_name(const std::string& name) {
  const size_t dot = name.rfind('.');
  const std::string last = dot == std::string::npos ? name : name.substr(dot + 1);
  return last == "lora_A" || last == "lora_B";
}

}  // namespace

void LoraConfig::validate() const {
  TORCH_CHECK_VALUE(rank >= 1, "LoraConfig: rank must be >= 1, got ", rank);
  TORCH_CHECK_VALUE(std::isfinite(alpha) && alpha > 0, "LoraConfig: alpha must be positive, got ",
                    alpha);
  TORCH_CHECK_VALUE(!target_modules.empty(), "LoraConfig: target_modules is empty");
  for (const std::string& name : target_modules) {
    TORCH_CHECK_VALUE(known_modules().count(name) == 1, "LoraConfig: unknown target module '", name,
                      "' (known: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)");
  }
  if (!frozen_weights.empty()) check_frozen_weight_format(frozen_weights, "LoraConfig: frozen_weights");
}

int64_t apply_lora(torch::nn::Sequential& decoder, const LoraConfig& config) {
  config.validate();
  // Check everything before changing anything.
  TORCH_CHECK_VALUE(!decoder.is_empty(), "apply_lora: the Sequential is a null holder; pass one made by make_decoder");
  const size_t n = decoder->size();
  TORCH_CHECK_VALUE(n >= 2, "apply_lora: expects a Sequential made by make_decoder, got ", n,
                    " layer(s)");
  auto expect_layer = [&](size_t i, bool ok, const char* want) {
    TORCH_CHECK_VALUE(ok, "apply_lora: expects a Sequential made by make_decoder, but layer ", i,
                      " is ", decoder[i]->name(), ", not ", want);
  };
  expect_layer(0, decoder[0]->as<DecoderEmbeddingImpl>() != nullptr, "DecoderEmbedding");
  expect_layer(n - 1, decoder[n - 1]->as<LmHeadImpl>() != nullptr, "LmHead");
  std::vector<DecoderBlockImpl*> blocks;
  for (size_t i = 1; i + 1 < n; ++i) {
    auto* block = decoder[i]->as<DecoderBlockImpl>();
    expect_layer(i, block != nullptr, "DecoderBlock");
    blocks.push_back(block);
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (const std::string& name : known_modules()) {
      TORCH_CHECK_VALUE(!projection_of(*blocks[i], name)->has_adapter(), "apply_lora: layer ",
                        i + 1, " already has a LoRA adapter on ", name,
                        " (apply_lora was called twice)");
    }
  }
  const std::set<std::string> targets(config.target_modules.begin(), config.target_modules.end());

  for (auto& p : decoder->parameters()) p.requires_grad_(false);
  const double scaling = config.alpha / double(config.rank);
  int64_t adapted = 0;
  for (DecoderBlockImpl* block : blocks) {
    for (const std::string& name : targets) {
      projection_of(*block, name)->add_adapter(config.rank, scaling);
      ++adapted;
    }
  }
  // Every base weight is frozen now: pack them, one projection at a time.
  if (!config.frozen_weights.empty()) pack_frozen_weights(decoder, config.frozen_weights);
  return adapted;
}

std::vector<std::pair<std::string, at::Tensor>> lora_parameters(
    const torch::nn::Sequential& decoder) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : decoder->named_parameters()) {
    if (is_adapter_name(item.key())) out.emplace_back(item.key(), item.value());
  }
  return out;
}

}  // namespace roundpipe
