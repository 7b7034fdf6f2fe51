// The decoder presets as a plain function of Hugging Face-named weights,
// written from the transformers modeling code and sharing no code with the
// presets (with LoRA adapters, as PEFT computes them, when the weights hold
// "<projection>.lora_A" / ".lora_B"), and helpers of the preset tests.
#pragma once

#include <roundpipe/presets.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>

#include <gtest/gtest.h>

namespace roundpipe {
namespace testing {

// A config small enough for fast gradient checks.
inline DecoderConfig small_config(const std::string& type, bool tied) {
  DecoderConfig c = type == "qwen3" ? tiny_qwen3_config() : tiny_llama_config();
  c.vocab_size = 48;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.tie_word_embeddings = tied;
  c.loss_chunk_size = 7;  // does not divide B * T
  return c;
}

// The preset as a plain function of Hugging Face-named weights, written from
// the transformers modeling code, sharing no code with the preset.
inline at::Tensor reference_rms(const at::Tensor& x, const at::Tensor& w, double eps) {
  return w * (x * torch::rsqrt(x.pow(2).mean(-1, true) + eps));
}

inline at::Tensor reference_rotate(const at::Tensor& x, const at::Tensor& cos,
                                   const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return x * cos + torch::cat({-x2, x1}, -1) * sin;
}

inline at::Tensor reference_logits(const DecoderConfig& c, std::map<std::string, at::Tensor>& w,
                                   const at::Tensor& ids, double lora_scaling = 0.0) {
  const int64_t b = ids.size(0), t = ids.size(1), h = c.num_attention_heads, kv = c.kv_heads(),
                hd = c.head_size();
  at::Tensor x =
      w.at("model.embed_tokens.weight").index_select(0, ids.reshape({-1})).view({b, t, -1});
  std::vector<double> inv(hd / 2);
  for (int64_t i = 0; i < hd / 2; ++i)
    inv[i] = 1.0 / std::pow(c.rope_theta, double(2 * i) / double(hd));
  at::Tensor ang = torch::empty({t, hd});
  for (int64_t p = 0; p < t; ++p)
    for (int64_t i = 0; i < hd; ++i) ang[p][i] = float(p) * float(inv[i % (hd / 2)]);
  at::Tensor cos = ang.cos(), sin = ang.sin();
  at::Tensor mask = torch::full({t, t}, -1e30).triu(1);
  auto lin = [&](const at::Tensor& in, const std::string& name) {
    at::Tensor out = in.matmul(w.at(name + ".weight").t());
    auto bias = w.find(name + ".bias");
    if (bias != w.end()) out = out + bias->second;
    auto a = w.find(name + ".lora_A");  // LoRA: + scaling * (x A^T) B^T
    if (a == w.end()) return out;
    return out + lora_scaling * in.matmul(a->second.t()).matmul(w.at(name + ".lora_B").t());
  };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    at::Tensor a = reference_rms(x, w.at(p + "input_layernorm.weight"), c.rms_norm_eps);
    at::Tensor q = lin(a, p + "self_attn.q_proj").view({b, t, h, hd});
    at::Tensor k = lin(a, p + "self_attn.k_proj").view({b, t, kv, hd});
    at::Tensor v = lin(a, p + "self_attn.v_proj").view({b, t, kv, hd});
    if (c.model_type == "qwen3") {
      q = reference_rms(q, w.at(p + "self_attn.q_norm.weight"), c.rms_norm_eps);
      k = reference_rms(k, w.at(p + "self_attn.k_norm.weight"), c.rms_norm_eps);
    }
    q = reference_rotate(q.permute({0, 2, 1, 3}), cos, sin);
    k = reference_rotate(k.permute({0, 2, 1, 3}), cos, sin);
    v = v.permute({0, 2, 1, 3});
    // Each kv head serves h / kv consecutive query heads.
    k = k.unsqueeze(2).expand({b, kv, h / kv, t, hd}).reshape({b, h, t, hd});
    v = v.unsqueeze(2).expand({b, kv, h / kv, t, hd}).reshape({b, h, t, hd});
    at::Tensor att =
        torch::softmax(q.matmul(k.transpose(-1, -2)) / std::sqrt(double(hd)) + mask, -1);
    x = x +
        lin(att.matmul(v).permute({0, 2, 1, 3}).reshape({b, t, h * hd}), p + "self_attn.o_proj");
    at::Tensor m = reference_rms(x, w.at(p + "post_attention_layernorm.weight"), c.rms_norm_eps);
    x = x + lin(torch::silu(lin(m, p + "mlp.gate_proj")) * lin(m, p + "mlp.up_proj"),
                p + "mlp.down_proj");
  }
  x = reference_rms(x, w.at("model.norm.weight"), c.rms_norm_eps);
  return x.matmul(w.at(c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight").t());
}

// Leaf copies of the preset's weights under Hugging Face names.
inline std::map<std::string, at::Tensor> hf_weights(const DecoderConfig& c,
                                                    torch::nn::Sequential& net) {
  auto params = net->named_parameters();
  std::map<std::string, at::Tensor> out;
  for (const auto& [ours, hf] : hf_parameter_names(c))
    out[hf] = params[ours].detach().clone().requires_grad_();
  return out;
}

inline at::Tensor full_loss(const at::Tensor& logits, const at::Tensor& labels) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              labels.reshape({-1}));
}

inline void expect_close(const at::Tensor& a, const at::Tensor& b, double rtol,
                         const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double diff = (a - b).abs().max().item<double>(), scale = b.abs().max().item<double>();
  EXPECT_LE(diff, rtol * scale) << what << ": max diff " << diff << ", scale " << scale;
}

}  // namespace testing
}  // namespace roundpipe
