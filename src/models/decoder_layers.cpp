// The layers of the decoder presets: RMSNorm, rotary embeddings, attention,
// MLP, and the embedding / block / head value layers.
#include <ATen/ATen.h>
#include <torch/nn/init.h>
#include <torch/version.h>

#include <cmath>
#include <limits>
#include <utility>

#include "roundpipe/packed_linear.h"
#include "roundpipe/presets.h"

namespace roundpipe {
namespace {

// Hugging Face's _init_weights: normal(0, std) weights, zero biases.
Projection make_linear(int64_t in, int64_t out, bool bias, double std) {
  Projection l(in, out, bias);
  torch::NoGradGuard no_grad;
  l->weight.normal_(0.0, std);
  if (l->bias.defined()) l->bias.zero_();
  return l;
}

c10::IValue pack_state(at::Tensor hidden, at::Tensor cos, at::Tensor sin, c10::IValue labels) {
  return c10::ivalue::Tuple::create(
      {std::move(hidden), std::move(cos), std::move(sin), std::move(labels)});
}

// The state tuple of a block or the head (see presets.h).
std::vector<c10::IValue> unpack_state(const std::vector<c10::IValue>& args, const char* who) {
  TORCH_CHECK_TYPE(
      args.size() == 1 && args[0].isTuple() && args[0].toTupleRef().elements().size() == 4, who,
      " expects the state tuple (hidden, cos, sin, labels) of the previous layer");
  std::vector<c10::IValue> e = args[0].toTupleRef().elements().vec();
  TORCH_CHECK_TYPE(
      e[0].isTensor() && e[1].isTensor() && e[2].isTensor() && (e[3].isNone() || e[3].isTensor()),
      who, " expects the state tuple (hidden, cos, sin, labels) of the previous layer");
  return e;
}

// Inverse frequencies [head_dim / 2], fp32, with the configured scaling.
at::Tensor inverse_frequencies(const DecoderConfig& c) {
  const int64_t hd = c.head_size();
  at::Tensor inv =
      1.0 / at::pow(c.rope_theta, at::arange(0, hd, 2, at::kLong).to(at::kFloat) / double(hd));
  const RopeScaling& rs = c.rope_scaling;
  if (rs.rope_type == "linear") return inv / rs.factor;
  if (rs.rope_type != "llama3") return inv;
  const double old_len = double(rs.original_max_position_embeddings);
  const double low_wavelen = old_len / rs.low_freq_factor;
  const double high_wavelen = old_len / rs.high_freq_factor;
  const double two_pi = 6.283185307179586;
  at::Tensor wavelen = two_pi / inv;
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv / rs.factor, inv);
  at::Tensor smooth =
      (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
  at::Tensor smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled;
  at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return at::where(medium, smoothed, scaled);
}

}  // namespace

// ---- RMSNorm ----

RMSNormImpl::RMSNormImpl(int64_t dim_, double eps_) : dim(dim_), eps(eps_) { reset(); }

void RMSNormImpl::reset() { weight = register_parameter("weight", torch::ones({dim})); }

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}

// ---- Projection ----

ProjectionImpl::ProjectionImpl(int64_t in, int64_t out, bool bias_)
    : in_features(in), out_features(out), with_bias(bias_) {
  reset();
}

void ProjectionImpl::reset() {
  // As torch::nn::Linear (same draws from the generator, in the same order).
  // A packed projection's clone gets no weight: its packed tensors come instead.
  if (!is_packed())
    weight = register_parameter("weight", torch::empty({out_features, in_features}));
  if (with_bias) bias = register_parameter("bias", torch::empty({out_features}));
  {
    torch::NoGradGuard no_grad;
    if (!is_packed()) torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
    if (with_bias) {
      const double bound = in_features > 0 ? 1.0 / std::sqrt(double(in_features)) : 0.0;
      bias.uniform_(-bound, bound);
    }
  }
  if (is_packed()) reset_packed();
  if (lora_rank > 0) reset_adapter();
}

// Placeholders of the packed tensors' names and dtypes (clone() then sets
// their data).
void ProjectionImpl::reset_packed() {
  const at::Tensor probe = at::zeros({1, 1}, at::TensorOptions().dtype(weight_dtype));
  std::vector<at::Tensor> tensors;
  for (const auto& [name, t] : quantize_weight(probe, packed_format)) {
    tensors.push_back(
        register_parameter(name, at::empty({0}, t.options()), /*requires_grad=*/false));
  }
  packed_tensors = std::move(tensors);
}

void ProjectionImpl::pack_weight(const std::string& format) {
  check_frozen_weight_format(format, "Projection::pack_weight");
  TORCH_CHECK_VALUE(!is_packed(), "Projection::pack_weight: the weight is packed already (",
                    packed_format, ")");
  TORCH_CHECK_VALUE(!weight.requires_grad(), "Projection::pack_weight: frozen weights are packed (",
                    format,
                    "), but this weight is trained (requires_grad true): freeze it (apply_lora "
                    "freezes every base weight) or leave it unpacked");
  std::vector<std::pair<std::string, at::Tensor>> packed = quantize_weight(weight, format);
  const at::ScalarType dtype = weight.scalar_type();
  // The full-precision weight goes as its packed form comes.
  parameters_.erase("weight");
  weight = at::Tensor();
  packed_format = format;
  weight_dtype = dtype;
  packed_tensors.clear();
  // Frozen parameters, not buffers: the engine keeps parameters in its host
  // slab (exact size, page-locked) and uploads a stage's in one copy.
  for (auto& [name, t] : packed) {
    packed_tensors.push_back(register_parameter(name, std::move(t), /*requires_grad=*/false));
  }
  if (has_adapter()) {
    // The adapter after the packed tensors, the order reset() registers them
    // in: a replica (a clone) binds its master's parameters by position.
    const bool a_trained = lora_A.requires_grad(), b_trained = lora_B.requires_grad();
    parameters_.erase("lora_A");
    parameters_.erase("lora_B");
    lora_A = register_parameter("lora_A", lora_A, a_trained);
    lora_B = register_parameter("lora_B", lora_B, b_trained);
  }
}

at::Tensor ProjectionImpl::dense_weight() const {
  if (!is_packed()) return weight;
  return dequantize_weight(packed_format, packed_tensors, out_features, in_features, weight_dtype);
}

void ProjectionImpl::to(torch::Dtype dtype, bool non_blocking) {
  if (!is_packed()) return torch::nn::Module::to(dtype, non_blocking);
  // The codes and their scales keep their dtypes: only the computation's changes.
  for (at::Tensor* p : {&bias, &lora_A, &lora_B}) {
    if (p->defined()) p->set_data(p->to(dtype, non_blocking));
  }
  weight_dtype = dtype;
}

void ProjectionImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  if (!is_packed()) return torch::nn::Module::to(device, dtype, non_blocking);
  torch::nn::Module::to(device, non_blocking);
  to(dtype, non_blocking);
}

void ProjectionImpl::reset_adapter() {
  const at::TensorOptions options =
      is_packed() ? packed_tensors.front().options().dtype(weight_dtype) : weight.options();
  lora_A = register_parameter("lora_A", torch::empty({lora_rank, in_features}, options));
  lora_B = register_parameter("lora_B", torch::zeros({out_features, lora_rank}, options));
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(lora_A, std::sqrt(5.0));
}

void ProjectionImpl::add_adapter(int64_t rank, double scaling) {
  TORCH_CHECK_VALUE(rank >= 1, "Projection::add_adapter: rank must be >= 1, got ", rank);
  TORCH_CHECK_VALUE(lora_rank == 0,
                    "Projection::add_adapter: the projection already has an adapter");
  lora_rank = rank;
  lora_scaling = scaling;
  reset_adapter();
}

at::Tensor ProjectionImpl::forward(const at::Tensor& x) {
  // A packed weight is dequantized here, on the layer's device, and dropped
  // after the matmul.
  at::Tensor y = at::linear(x, dense_weight(), bias);
  if (lora_rank == 0) return y;
  return y + at::linear(at::linear(x, lora_A), lora_B) * lora_scaling;
}

// ---- Rotary embeddings ----

std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const DecoderConfig& config, int64_t seq_len) {
  at::Tensor inv = inverse_frequencies(config);                    // [hd/2]
  at::Tensor pos = at::arange(seq_len, at::kLong).to(at::kFloat);  // [T]
  at::Tensor freqs = pos.unsqueeze(1) * inv.unsqueeze(0);          // [T, hd/2]
  at::Tensor emb = at::cat({freqs, freqs}, -1);                    // [T, hd]
  return {emb.cos(), emb.sin()};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  auto halves = x.chunk(2, -1);
  at::Tensor rotated = at::cat({-halves[1], halves[0]}, -1);
  return x * cos.to(x.scalar_type()) + rotated * sin.to(x.scalar_type());
}

// ---- Attention ----

DecoderAttentionImpl::DecoderAttentionImpl(DecoderConfig c) : config(std::move(c)) {
  config.validate();
  reset();
}

void DecoderAttentionImpl::reset() {
  const int64_t d = config.hidden_size, hd = config.head_size();
  const int64_t h = config.num_attention_heads, kv = config.kv_heads();
  const bool b = config.attention_bias;
  const double std = config.initializer_range;
  q_proj = register_module("q_proj", make_linear(d, h * hd, b, std));
  k_proj = register_module("k_proj", make_linear(d, kv * hd, b, std));
  v_proj = register_module("v_proj", make_linear(d, kv * hd, b, std));
  o_proj = register_module("o_proj", make_linear(h * hd, d, b, std));
  if (config.qk_norm()) {
    q_norm = register_module("q_norm", RMSNorm(hd, config.rms_norm_eps));
    k_norm = register_module("k_norm", RMSNorm(hd, config.rms_norm_eps));
  }
}

at::Tensor DecoderAttentionImpl::forward(const at::Tensor& hidden, const at::Tensor& cos,
                                         const at::Tensor& sin) {
  const int64_t b = hidden.size(0), t = hidden.size(1);
  const int64_t h = config.num_attention_heads, kv = config.kv_heads(), hd = config.head_size();
  at::Tensor q = q_proj(hidden).view({b, t, h, hd});   // [B, T, H, hd]
  at::Tensor k = k_proj(hidden).view({b, t, kv, hd});  // [B, T, KV, hd]
  at::Tensor v = v_proj(hidden).view({b, t, kv, hd});
  if (config.qk_norm()) {
    q = q_norm(q);
    k = k_norm(k);
  }
  q = apply_rotary(q.transpose(1, 2), cos, sin);  // [B, H, T, hd]
  k = apply_rotary(k.transpose(1, 2), cos, sin);  // [B, KV, T, hd]
  v = v.transpose(1, 2);
  // Causal attention through torch's fused kernels (flash / memory-efficient
  // on GPUs): no T x T score matrix is kept for backward.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  at::Tensor out = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                    /*is_causal=*/true, /*scale=*/c10::nullopt,
                                                    /*enable_gqa=*/kv != h);  // [B, H, T, hd]
#else
  if (kv != h) {  // grouped-query: query head j reads kv head j / (H / KV)
    k = k.repeat_interleave(h / kv, 1);
    v = v.repeat_interleave(h / kv, 1);
  }
  at::Tensor out = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#endif
  return o_proj(out.transpose(1, 2).reshape({b, t, h * hd}));
}

// ---- MLP ----

DecoderMlpImpl::DecoderMlpImpl(DecoderConfig c) : config(std::move(c)) {
  config.validate();
  reset();
}

void DecoderMlpImpl::reset() {
  const int64_t d = config.hidden_size, f = config.intermediate_size;
  const bool b = config.mlp_bias;
  const double std = config.initializer_range;
  gate_proj = register_module("gate_proj", make_linear(d, f, b, std));
  up_proj = register_module("up_proj", make_linear(d, f, b, std));
  down_proj = register_module("down_proj", make_linear(f, d, b, std));
}

at::Tensor DecoderMlpImpl::forward(const at::Tensor& x) {
  return down_proj(at::silu(gate_proj(x)) * up_proj(x));
}

// ---- Embedding ----

DecoderEmbeddingImpl::DecoderEmbeddingImpl(DecoderConfig c) : config(std::move(c)) {
  config.validate();
  reset();
}

void DecoderEmbeddingImpl::reset() {
  embed_tokens =
      register_module("embed_tokens", torch::nn::Embedding(config.vocab_size, config.hidden_size));
  torch::NoGradGuard no_grad;
  embed_tokens->weight.normal_(0.0, config.initializer_range);
}

c10::IValue DecoderEmbeddingImpl::forward(std::vector<c10::IValue> args, Kwargs kwargs) {
  TORCH_CHECK_TYPE(!args.empty() && args.size() <= 2 && args[0].isTensor(),
                   "DecoderEmbedding expects input_ids [B, T] and optionally labels [B, T]");
  at::Tensor ids = args[0].toTensor();
  TORCH_CHECK_VALUE(ids.dim() == 2, "DecoderEmbedding: input_ids must be [B, T], got ",
                    ids.sizes());
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
                   "DecoderEmbedding: input_ids must be integers, got ", ids.scalar_type());
  c10::IValue labels = args.size() == 2 ? args[1] : c10::IValue();
  for (const auto& item : kwargs) {
    TORCH_CHECK_TYPE(item.key() == "labels", "DecoderEmbedding: unexpected keyword argument '",
                     item.key(), "' (only 'labels')");
    TORCH_CHECK_TYPE(args.size() == 1,
                     "DecoderEmbedding: labels given both positionally and by keyword");
    labels = item.value();
  }
  if (!labels.isNone()) {
    TORCH_CHECK_TYPE(labels.isTensor(), "DecoderEmbedding: labels must be a tensor or None");
    TORCH_CHECK_VALUE(labels.toTensor().sizes() == ids.sizes(), "DecoderEmbedding: labels ",
                      labels.toTensor().sizes(), " must have the shape of input_ids ", ids.sizes());
  }
  auto [cos, sin] = rotary_cos_sin(config, ids.size(1));
  return pack_state(embed_tokens(ids.to(at::kLong)), cos.to(ids.device()), sin.to(ids.device()),
                    std::move(labels));
}

// ---- Decoder block ----

DecoderBlockImpl::DecoderBlockImpl(DecoderConfig c) : config(std::move(c)) {
  config.validate();
  reset();
}

void DecoderBlockImpl::reset() {
  input_layernorm =
      register_module("input_layernorm", RMSNorm(config.hidden_size, config.rms_norm_eps));
  self_attn = register_module("self_attn", DecoderAttention(config));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(config.hidden_size, config.rms_norm_eps));
  mlp = register_module("mlp", DecoderMlp(config));
}

c10::IValue DecoderBlockImpl::forward(std::vector<c10::IValue> args, Kwargs kwargs) {
  const std::vector<c10::IValue> s = unpack_state(args, "DecoderBlock");
  at::Tensor h = s[0].toTensor(), cos = s[1].toTensor(), sin = s[2].toTensor();
  h = h + self_attn(input_layernorm(h), cos, sin);
  h = h + mlp(post_attention_layernorm(h));
  return pack_state(h, cos, sin, s[3]);
}

// ---- Head ----

LmHeadProjectionImpl::LmHeadProjectionImpl(int64_t v, int64_t d, double std, at::Tensor tied_)
    : vocab_size(v), hidden_size(d), init_std(std), tied(std::move(tied_)) {
  reset();
}

void LmHeadProjectionImpl::reset() {
  if (tied.defined()) {
    TORCH_CHECK_VALUE(tied.sizes() == at::IntArrayRef({vocab_size, hidden_size}),
                      "LmHeadProjection: the tied weight must be [", vocab_size, ", ", hidden_size,
                      "], got ", tied.sizes());
    weight = register_parameter("weight", std::exchange(tied, {}));
    return;
  }
  weight = register_parameter("weight", torch::empty({vocab_size, hidden_size}));
  torch::NoGradGuard no_grad;
  weight.normal_(0.0, init_std);
}

LmHeadImpl::LmHeadImpl(DecoderConfig c, at::Tensor tied)
    : config(std::move(c)), tied_embedding(std::move(tied)) {
  config.validate();
  reset();
}

void LmHeadImpl::reset() {
  norm = register_module("norm", RMSNorm(config.hidden_size, config.rms_norm_eps));
  lm_head = register_module(
      "lm_head", LmHeadProjection(config.vocab_size, config.hidden_size, config.initializer_range,
                                  std::exchange(tied_embedding, {})));
}

c10::IValue LmHeadImpl::forward(std::vector<c10::IValue> args, Kwargs kwargs) {
  const std::vector<c10::IValue> s = unpack_state(args, "LmHead");
  at::Tensor h = norm(s[0].toTensor());   // [B, T, D]
  const at::Tensor& w = lm_head->weight;  // [V, D]
  if (s[3].isNone()) return at::matmul(h, w.t());
  at::Tensor labels = s[3].toTensor();
  return chunked_cross_entropy(h.reshape({-1, h.size(-1)}), w, labels.reshape({-1}).to(at::kLong),
                               config.loss_chunk_size);
}

}  // namespace roundpipe
