#include "export.h"

#include <roundpipe/packed_linear.h>
#include <roundpipe/safetensors.h>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace roundpipe {
namespace train {
namespace {

using json = nlohmann::json;

std::string torch_dtype_name(const std::string& dtype) {
  if (dtype == "bf16") return "bfloat16";
  if (dtype == "fp16") return "float16";
  return "float32";
}

// Written beside `path` and renamed over it, as the safetensors files are.
void write_text(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      TORCH_CHECK(false, "cannot write '", path, "': ", std::strerror(errno));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    TORCH_CHECK(false, "cannot write '", path, "': ", std::strerror(err));
  }
}

// transformers' config.json for `c` (the keys of save_pretrained's file).
json config_json(const DecoderConfig& c) {
  const bool qwen3 = c.model_type == "qwen3";
  json rope = {{"rope_type", c.rope_scaling.rope_type}, {"rope_theta", c.rope_theta}};
  if (c.rope_scaling.rope_type != "default") rope["factor"] = c.rope_scaling.factor;
  if (c.rope_scaling.rope_type == "llama3") {
    rope["low_freq_factor"] = c.rope_scaling.low_freq_factor;
    rope["high_freq_factor"] = c.rope_scaling.high_freq_factor;
    rope["original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings;
  }
  json out = {{"architectures", json::array({qwen3 ? "Qwen3ForCausalLM" : "LlamaForCausalLM"})},
              {"model_type", c.model_type},
              {"vocab_size", c.vocab_size},
              {"hidden_size", c.hidden_size},
              {"intermediate_size", c.intermediate_size},
              {"num_hidden_layers", c.num_hidden_layers},
              {"num_attention_heads", c.num_attention_heads},
              {"num_key_value_heads", c.kv_heads()},
              {"head_dim", c.head_size()},
              {"hidden_act", "silu"},
              {"max_position_embeddings", c.max_position_embeddings},
              {"rms_norm_eps", c.rms_norm_eps},
              {"rope_parameters", rope},
              {"tie_word_embeddings", c.tie_word_embeddings},
              {"attention_bias", c.attention_bias},
              {"attention_dropout", 0.0},
              {"initializer_range", c.initializer_range},
              {"use_cache", true}};
  if (qwen3) {
    out["use_sliding_window"] = false;
  } else {
    out["mlp_bias"] = c.mlp_bias;
  }
  return out;
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str());
}

bool is_shard_name(const std::string& name) {
  // model-00001-of-00003.safetensors
  if (name.size() != 32 || name.rfind("model-", 0) != 0 || name.compare(11, 4, "-of-") != 0 ||
      name.compare(20, 12, ".safetensors") != 0) {
    return false;
  }
  for (size_t i : {6, 7, 8, 9, 10, 15, 16, 17, 18, 19}) {
    if (name[i] < '0' || name[i] > '9') return false;
  }
  return true;
}

// The files of an earlier export that this one does not replace.
void remove_stale(const std::string& dir, const std::set<std::string>& written, bool lora) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> stale;
  while (const dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    const bool ours =
        name == "model.safetensors" || name == kSafetensorsIndexName || is_shard_name(name) ||
        (!lora && (name == "adapter_config.json" || name == "adapter_model.safetensors"));
    if (ours && written.count(name) == 0) stale.push_back(name);
  }
  ::closedir(d);
  for (const std::string& name : stale) std::remove((dir + "/" + name).c_str());
}

std::string absolute(const std::string& path) {
  char buf[PATH_MAX];
  return ::realpath(path.c_str(), buf) != nullptr ? std::string(buf) : path;
}

}  // namespace

std::string save_hf(const torch::nn::Sequential& net, const DecoderConfig& config,
                    const HfExport& e) {
  if (::mkdir(e.dir.c_str(), 0777) != 0 && errno != EEXIST) {
    TORCH_CHECK(false, "--save-hf ", e.dir,
                ": cannot create the directory: ", std::strerror(errno));
  }
  const std::string dir = e.dir;
  std::set<std::string> written;

  json cfg = e.source_config.empty() ? config_json(config) : read_json(e.source_config);
  cfg["dtype"] = torch_dtype_name(e.dtype);
  if (cfg.contains("torch_dtype")) cfg["torch_dtype"] = cfg["dtype"];
  write_text(dir + "/config.json", cfg.dump(2) + "\n");
  written.insert("config.json");

  // The weights by their Hugging Face names: the masters after synchronize().
  const auto params = net->named_parameters();
  // Packed frozen weights (--frozen-weights) are written dequantized: the base
  // the adapters were trained against, in the model's dtype.
  std::map<std::string, at::Tensor> dequantized;
  for (auto& [name, t] : dequantized_frozen_weights(net)) dequantized.emplace(name, std::move(t));
  NamedTensors tensors;
  uint64_t bytes = 0;
  for (const auto& [ours, hf] : hf_parameter_names(config)) {
    const auto packed = dequantized.find(ours);
    const at::Tensor& t = packed != dequantized.end() ? packed->second : params[ours];
    tensors.emplace_back(hf, t);
    bytes += t.numel() * t.element_size();
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  std::string weights = "model.safetensors";
  if (bytes <= e.max_shard_bytes) {
    save_safetensors(dir + "/model.safetensors", tensors, metadata);
    written.insert("model.safetensors");
  } else {
    const std::string index = save_safetensors_sharded(dir, tensors, e.max_shard_bytes, metadata);
    written.insert(kSafetensorsIndexName);
    const json map = read_json(index)["weight_map"];
    std::set<std::string> shards;
    for (const auto& item : map.items()) shards.insert(item.value().get<std::string>());
    written.insert(shards.begin(), shards.end());
    weights = std::to_string(shards.size()) + " shards and " + kSafetensorsIndexName;
  }
  if (!dequantized.empty()) weights += " with the packed frozen weights dequantized";

  std::string adapter;
  if (e.lora_rank > 0) {
    // PEFT's names: base_model.model.<the transformers name>.lora_A.weight.
    NamedTensors adapters;
    for (const auto& [name, t] : lora_parameters(net)) {
      const size_t dot = name.find('.');
      const int64_t layer = std::stoll(name.substr(0, dot)) - 1;  // layer 0 is the embedding
      adapters.emplace_back(
          "base_model.model.model.layers." + std::to_string(layer) + name.substr(dot) + ".weight",
          t);
    }
    save_safetensors(dir + "/adapter_model.safetensors", adapters, metadata);
    const double alpha = e.lora.alpha;
    json acfg = {{"peft_type", "LORA"},
                 {"task_type", "CAUSAL_LM"},
                 {"base_model_name_or_path", absolute(dir)},
                 {"r", e.lora_rank},
                 {"target_modules", e.lora.target_modules},
                 {"bias", "none"},
                 {"lora_dropout", 0.0},
                 {"fan_in_fan_out", false},
                 {"inference_mode", true},
                 {"init_lora_weights", true},
                 {"modules_to_save", nullptr},
                 {"use_rslora", false},
                 {"use_dora", false}};
    if (alpha == std::floor(alpha) && std::abs(alpha) < 1e15) {
      acfg["lora_alpha"] = static_cast<int64_t>(alpha);
    } else {
      acfg["lora_alpha"] = alpha;
    }
    write_text(dir + "/adapter_config.json", acfg.dump(2) + "\n");
    written.insert({"adapter_model.safetensors", "adapter_config.json"});
    adapter = "; LoRA adapter: adapter_config.json, adapter_model.safetensors";
  }
  remove_stale(dir, written, e.lora_rank > 0);
  return "Hugging Face model written to " + dir + " (config.json, " + weights + adapter + ")";
}

}  // namespace train
}  // namespace roundpipe
