// DecoderConfig: validation, Hugging Face config.json parsing, tiny presets.
#include <c10/util/Exception.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "roundpipe/presets.h"

namespace roundpipe {
namespace {

using json = nlohmann::json;

const json* find(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

int64_t get_int(const json& j, const char* key, c10::optional<int64_t> fallback) {
  const json* v = find(j, key);
  if (v == nullptr) {
    TORCH_CHECK_VALUE(fallback.has_value(), "config.json: missing required field '", key, "'");
    return *fallback;
  }
  TORCH_CHECK_VALUE(v->is_number_integer(), "config.json: '", key, "' must be an integer, got ",
                    v->dump());
  return v->get<int64_t>();
}

double get_double(const json& j, const char* key, double fallback) {
  const json* v = find(j, key);
  if (v == nullptr) return fallback;
  TORCH_CHECK_VALUE(v->is_number(), "config.json: '", key, "' must be a number, got ", v->dump());
  return v->get<double>();
}

bool get_bool(const json& j, const char* key, bool fallback) {
  const json* v = find(j, key);
  if (v == nullptr) return fallback;
  TORCH_CHECK_VALUE(v->is_boolean(), "config.json: '", key, "' must be true or false, got ",
                    v->dump());
  return v->get<bool>();
}

std::string get_string(const json& j, const char* key, c10::optional<std::string> fallback) {
  const json* v = find(j, key);
  if (v == nullptr) {
    TORCH_CHECK_VALUE(fallback.has_value(), "config.json: missing required field '", key, "'");
    return *fallback;
  }
  TORCH_CHECK_VALUE(v->is_string(), "config.json: '", key, "' must be a string, got ", v->dump());
  return v->get<std::string>();
}

c10::optional<at::ScalarType> parse_dtype(const std::string& name) {
  if (name == "float32" || name == "float") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16" || name == "half") return at::kHalf;
  if (name == "float64" || name == "double") return at::kDouble;
  TORCH_CHECK_VALUE(false, "config.json: unknown torch_dtype '", name, "'");
}

RopeScaling parse_rope_fields(const json& v, const char* key) {
  TORCH_CHECK_VALUE(v.is_object(), "config.json: '", key, "' must be an object or null, got ", v.dump());
  RopeScaling out;
  // Older files name the type "type", newer ones "rope_type".
  out.rope_type = get_string(v, "rope_type", get_string(v, "type", std::string("default")));
  out.factor = get_double(v, "factor", 1.0);
  out.low_freq_factor = get_double(v, "low_freq_factor", out.low_freq_factor);
  out.high_freq_factor = get_double(v, "high_freq_factor", out.high_freq_factor);
  out.original_max_position_embeddings =
      get_int(v, "original_max_position_embeddings", out.original_max_position_embeddings);
  return out;
}

// Rotary settings: "rope_theta" + "rope_scaling", or (transformers >= 5)
// one "rope_parameters" object holding both.
void parse_rope(const json& j, DecoderConfig& c) {
  c.rope_theta = get_double(j, "rope_theta", 10000.0);
  if (const json* v = find(j, "rope_scaling")) c.rope_scaling = parse_rope_fields(*v, "rope_scaling");
  if (const json* v = find(j, "rope_parameters")) {
    c.rope_scaling = parse_rope_fields(*v, "rope_parameters");
    c.rope_theta = get_double(*v, "rope_theta", c.rope_theta);
  }
}

}  // namespace

void DecoderConfig::validate() const {
  TORCH_CHECK_VALUE(model_type == "llama" || model_type == "qwen3", "DecoderConfig: model_type '",
                    model_type, "' is not supported (\"llama\" or \"qwen3\")");
  auto positive = [](const char* name, int64_t v) {
    TORCH_CHECK_VALUE(v > 0, "DecoderConfig: ", name, " must be positive, got ", v);
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("max_position_embeddings", max_position_embeddings);
  positive("loss_chunk_size", loss_chunk_size);
  TORCH_CHECK_VALUE(num_key_value_heads >= 0,
                    "DecoderConfig: num_key_value_heads must be positive, got ",
                    num_key_value_heads);
  TORCH_CHECK_VALUE(head_dim >= 0, "DecoderConfig: head_dim must be positive, got ", head_dim);
  TORCH_CHECK_VALUE(num_attention_heads % kv_heads() == 0, "DecoderConfig: num_attention_heads (",
                    num_attention_heads, ") must be a multiple of num_key_value_heads (",
                    kv_heads(), ")");
  TORCH_CHECK_VALUE(head_dim > 0 || hidden_size % num_attention_heads == 0,
                    "DecoderConfig: hidden_size (", hidden_size,
                    ") must be a multiple of num_attention_heads (", num_attention_heads,
                    ") when head_dim is not given");
  TORCH_CHECK_VALUE(head_size() % 2 == 0, "DecoderConfig: the head dimension (", head_size(),
                    ") must be even for rotary embeddings");
  TORCH_CHECK_VALUE(rms_norm_eps > 0, "DecoderConfig: rms_norm_eps must be positive, got ",
                    rms_norm_eps);
  TORCH_CHECK_VALUE(rope_theta > 0, "DecoderConfig: rope_theta must be positive, got ", rope_theta);
  TORCH_CHECK_VALUE(initializer_range >= 0, "DecoderConfig: initializer_range must be >= 0, got ",
                    initializer_range);
  const std::string& rt = rope_scaling.rope_type;
  TORCH_CHECK_VALUE(rt == "default" || rt == "linear" || rt == "llama3",
                    "DecoderConfig: rope_scaling type '", rt,
                    "' is not supported (\"default\", \"linear\" or \"llama3\")");
  TORCH_CHECK_VALUE(rope_scaling.factor > 0,
                    "DecoderConfig: rope_scaling.factor must be positive, got ",
                    rope_scaling.factor);
  if (rt == "llama3") {
    TORCH_CHECK_VALUE(
        rope_scaling.high_freq_factor > rope_scaling.low_freq_factor &&
            rope_scaling.low_freq_factor > 0 && rope_scaling.original_max_position_embeddings > 0,
        "DecoderConfig: llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor and a "
        "positive original_max_position_embeddings");
  }
}

DecoderConfig from_hf_config_json(const std::string& json_text) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    TORCH_CHECK_VALUE(false, "config.json: not valid JSON (", e.what(), ")");
  }
  TORCH_CHECK_VALUE(j.is_object(), "config.json: expected a JSON object at the top level");
  DecoderConfig c;
  c.model_type = get_string(j, "model_type", c10::nullopt);
  TORCH_CHECK_VALUE(c.model_type == "llama" || c.model_type == "qwen3", "config.json: model_type '",
                    c.model_type, "' is not supported (\"llama\" or \"qwen3\")");
  const bool qwen3 = c.model_type == "qwen3";
  c.vocab_size = get_int(j, "vocab_size", c10::nullopt);
  c.hidden_size = get_int(j, "hidden_size", c10::nullopt);
  c.intermediate_size = get_int(j, "intermediate_size", c10::nullopt);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", c10::nullopt);
  c.num_attention_heads = get_int(j, "num_attention_heads", c10::nullopt);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", c.num_attention_heads);
  c.head_dim = get_int(j, "head_dim", 0);
  c.rms_norm_eps = get_double(j, "rms_norm_eps", 1e-6);
  parse_rope(j, c);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", qwen3 ? 32768 : 2048);
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", false);
  c.attention_bias = get_bool(j, "attention_bias", false);
  c.mlp_bias = get_bool(j, "mlp_bias", false);
  c.initializer_range = get_double(j, "initializer_range", 0.02);
  const std::string act = get_string(j, "hidden_act", std::string("silu"));
  TORCH_CHECK_VALUE(act == "silu", "config.json: hidden_act '", act,
                    "' is not supported (only \"silu\")");
  TORCH_CHECK_VALUE(!get_bool(j, "use_sliding_window", false),
                    "config.json: use_sliding_window is not supported");
  // transformers >= 5 writes "dtype".
  const json* d = find(j, "torch_dtype");
  if (d == nullptr) d = find(j, "dtype");
  if (d != nullptr) {
    TORCH_CHECK_VALUE(d->is_string(), "config.json: 'torch_dtype' must be a string, got ",
                      d->dump());
    c.torch_dtype = parse_dtype(d->get<std::string>());
  }
  c.validate();
  return c;
}

DecoderConfig load_hf_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK_VALUE(in.good(), "load_hf_config: cannot open '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  TORCH_CHECK_VALUE(!in.bad(), "load_hf_config: cannot read '", path, "'");
  try {
    return from_hf_config_json(text.str());
  } catch (const c10::ValueError& e) {
    TORCH_CHECK_VALUE(false, path, ": ", e.what_without_backtrace());
  }
}

DecoderConfig tiny_llama_config() {
  DecoderConfig c;
  c.model_type = "llama";
  c.vocab_size = 256;
  c.hidden_size = 128;
  c.intermediate_size = 384;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 128;
  c.tie_word_embeddings = false;
  return c;
}

DecoderConfig tiny_qwen3_config() {
  DecoderConfig c = tiny_llama_config();
  c.model_type = "qwen3";
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1000000.0;
  c.tie_word_embeddings = true;
  return c;
}

}  // namespace roundpipe
