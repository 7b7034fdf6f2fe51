// Transformer presets: Llama and Qwen3 dense decoders as a Sequential of
// value layers (layer.h), ready to wrap in a RoundPipe:
//
//   roundpipe::DecoderConfig cfg = roundpipe::load_hf_config("Qwen3-0.6B/config.json");
//   torch::nn::Sequential net = roundpipe::make_decoder(cfg);
//   //  layer 0:       DecoderEmbedding   input_ids [B, T] (+ labels) -> state
//   //  layers 1..L:   DecoderBlock       state -> state
//   //  layer L + 1:   LmHead             state -> logits [B, T, V], or the loss
//   roundpipe::RoundPipe model(net);
//   at::Tensor loss = model.forward_backward({ids}, roundpipe::make_kwargs({{"labels", targets}}),
//                                            c10::IValue(),
//                                            roundpipe::preset_loss_fn()).toTensor();
//
// The state passed between layers is the tuple
//   (hidden [B, T, D] model dtype, cos [T, head_dim] fp32, sin [T, head_dim] fp32,
//    labels [B, T] int64 or None).
// The embedding computes the rotary tables once per call (positions 0..T-1)
// and every block reuses them; the labels ride along untouched to the head.
//
// The math is Hugging Face's (transformers' LlamaForCausalLM /
// Qwen3ForCausalLM, eager attention), so their weights load unchanged by name
// (hf_parameter_names): RMSNorm computed in fp32; rotary embeddings with the
// non-interleaved rotate_half convention; grouped-query attention with a
// causal mask, softmax in fp32, scale head_dim^-0.5; Qwen3's per-head RMSNorm
// of q and k before the rotation; SwiGLU MLP down(silu(gate(x)) * up(x)).
// Attention is causal only: there is no padding mask (pad on the right and
// set the padded labels to ignore_index).
//
// Labels are the targets aligned with the positions (labels[b, t] is the
// token expected after input_ids[b, ..t]); unlike transformers, the head does
// not shift them. Positions whose label is ignore_index (-100) do not count.
//
// LoRA fine-tuning: apply_lora (lora.h) adds adapters to the projections and
// freezes everything else.
//
// Thread-safety: configs are values; modules are thread-compatible (RoundPipe
// runs a clone per device).
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <utility>
#include <vector>

#include <roundpipe/layer.h>
#include <roundpipe/microbatch.h>
#include <roundpipe/model.h>

namespace roundpipe {

// Rotary position scaling (config.json "rope_scaling"). Supported types:
// "default" (none), "linear" (positions divided by factor) and "llama3"
// (Llama 3.1's frequency-dependent scaling).
struct RopeScaling {
  std::string rope_type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0;                     // llama3
  double high_freq_factor = 4.0;                    // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3
};

// The architecture, with Hugging Face's field names and defaults.
struct DecoderConfig {
  std::string model_type = "llama";  // "llama" or "qwen3"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // 0: num_attention_heads (plain multi-head attention)
  int64_t head_dim = 0;             // 0: hidden_size / num_attention_heads
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // bias on q/k/v/o projections
  bool mlp_bias = false;        // bias on gate/up/down projections
  double initializer_range = 0.02;
  // "torch_dtype" of config.json, informational: presets are built in the
  // default dtype (convert with Module::to afterwards).
  c10::optional<at::ScalarType> torch_dtype;
  // Not a Hugging Face field: rows (flattened positions) per chunk of the
  // head's loss, so at most [loss_chunk_size, vocab_size] logits exist at once.
  int64_t loss_chunk_size = 1024;

  // Qwen3 normalizes q and k per head.
  bool qk_norm() const { return model_type == "qwen3"; }
  int64_t kv_heads() const {
    return num_key_value_heads > 0 ? num_key_value_heads : num_attention_heads;
  }
  int64_t head_size() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }

  // Throws c10::ValueError naming the first invalid field: a non-positive
  // size, an unknown model_type, num_attention_heads not a multiple of
  // num_key_value_heads, hidden_size not a multiple of num_attention_heads
  // when head_dim is 0, an odd head dimension, an unknown rope type.
  void validate() const;
};

// Parses a Hugging Face config.json (LlamaConfig or Qwen3Config). Required:
// model_type, vocab_size, hidden_size, intermediate_size, num_hidden_layers,
// num_attention_heads; every other field takes Hugging Face's default when
// absent. Throws c10::ValueError on invalid JSON, a missing or mistyped
// field, hidden_act other than "silu", Qwen3's use_sliding_window, or what
// DecoderConfig::validate rejects.
DecoderConfig from_hf_config_json(const std::string& json_text);
// Reads and parses `path` (c10::ValueError if it cannot be read, naming it).
DecoderConfig load_hf_config(const std::string& path);

// Tiny configs for tests and the default main job: byte-level vocabulary
// (256), hidden 128, intermediate 384, 4 layers, 4 heads of 32, 2 kv heads,
// 128 positions. Llama's is untied; Qwen3's is tied, with q/k norms.
DecoderConfig tiny_llama_config();
DecoderConfig tiny_qwen3_config();

// ---- Building blocks ----

// y = weight * (x / sqrt(mean(x^2, -1) + eps)), computed in fp32, returned
// in x's dtype. weight [dim] starts at ones.
class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl> {
 public:
  RMSNormImpl(int64_t dim, double eps);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);

  int64_t dim;
  double eps;
  at::Tensor weight;  // [dim]
};
TORCH_MODULE(RMSNorm);

// Rotary tables for positions 0..seq_len-1: (cos, sin), each [seq_len,
// head_dim] fp32, the frequencies repeated for both halves (Hugging Face).
std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const DecoderConfig& config, int64_t seq_len);
// x * cos + rotate_half(x) * sin; x [..., T, head_dim], tables cast to x's dtype.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// A linear projection, y = x @ weight^T (+ bias), with the parameter names of
// torch::nn::Linear ("weight" [out, in], "bias" [out] only when `bias`), so
// Hugging Face names hold. reset() initializes as torch::nn::Linear does
// (kaiming-uniform with a = sqrt(5); the presets then redraw the weight).
//
// Optionally it carries a low-rank adapter (LoRA, see lora.h), added by
// add_adapter: parameters "lora_A" [rank, in] (kaiming-uniform, a = sqrt(5))
// and "lora_B" [out, rank] (zeros), registered after weight and bias, and
//   y = x @ weight^T (+ bias) + lora_scaling * (x @ lora_A^T) @ lora_B^T.
// Clones (RoundPipe makes one per device) keep the adapter: reset()
// registers it whenever lora_rank > 0.
//
// A frozen weight may be kept packed (packed_linear.h): pack_weight drops the
// parameter "weight" and registers the packed tensors ("packed", "scales",
// ... as the Python PackedLinear's) as frozen parameters, and forward dequantizes them to
// weight_dtype for its matmul. Module::to(dtype) then changes weight_dtype,
// the bias and the adapter, never the codes or their scales.
class ProjectionImpl : public torch::nn::Cloneable<ProjectionImpl> {
 public:
  ProjectionImpl(int64_t in_features, int64_t out_features, bool bias);
  void reset() override;
  // x [..., in] -> [..., out].
  at::Tensor forward(const at::Tensor& x);
  // Registers lora_A and lora_B (in weight's dtype and device) and sets
  // lora_scaling. Throws c10::ValueError if rank < 1 or the projection
  // already has an adapter.
  void add_adapter(int64_t rank, double scaling);
  bool has_adapter() const { return lora_rank > 0; }
  // Packs the weight in `format` ("nf4", "fp4", "int8"). Throws
  // c10::ValueError, changing nothing, for an unknown format, a weight that
  // requires grad (trained weights are never packed) or one packed already.
  void pack_weight(const std::string& format);
  bool is_packed() const { return !packed_format.empty(); }
  // The weight [out, in]: `weight` itself, or dequantized from the packed tensors.
  at::Tensor dense_weight() const;

  using torch::nn::Module::to;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;

  int64_t in_features, out_features;
  bool with_bias;
  int64_t lora_rank = 0;      // 0: no adapter
  double lora_scaling = 0.0;  // alpha / rank
  at::Tensor weight;          // [out, in], undefined once packed
  at::Tensor bias;            // [out], undefined unless with_bias
  at::Tensor lora_A;          // [rank, in], undefined without an adapter
  at::Tensor lora_B;          // [out, rank], undefined without an adapter
  std::string packed_format;  // "" unless packed
  at::ScalarType weight_dtype = at::kFloat;  // the dequantized weight's (packed only)
  std::vector<at::Tensor> packed_tensors;    // in packed_linear.h's order (packed only)

 private:
  void reset_adapter();
  void reset_packed();
};
TORCH_MODULE(Projection);

// Causal grouped-query self-attention. Children: q_proj, k_proj, v_proj,
// o_proj (Projection), and with qk_norm q_norm, k_norm (RMSNorm over
// head_dim).
class DecoderAttentionImpl : public torch::nn::Cloneable<DecoderAttentionImpl> {
 public:
  explicit DecoderAttentionImpl(DecoderConfig config);
  void reset() override;
  // hidden [B, T, D], cos/sin [T, head_dim] -> [B, T, D].
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin);

  DecoderConfig config;
  Projection q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // null unless config.qk_norm()
};
TORCH_MODULE(DecoderAttention);

// SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)); the three are
// Projections.
class DecoderMlpImpl : public torch::nn::Cloneable<DecoderMlpImpl> {
 public:
  explicit DecoderMlpImpl(DecoderConfig config);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);

  DecoderConfig config;
  Projection gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(DecoderMlp);

// Layer 0. Called with input_ids [B, T] (int64) and optionally labels [B, T]
// (keyword "labels" or a second positional argument); returns the state
// tuple. Child: embed_tokens (torch::nn::Embedding [V, D]).
class DecoderEmbeddingImpl : public torch::nn::Cloneable<DecoderEmbeddingImpl>, public ValueLayer, public RandomFree {
 public:
  explicit DecoderEmbeddingImpl(DecoderConfig config);
  void reset() override;
  c10::IValue forward(std::vector<c10::IValue> args, Kwargs kwargs) override;

  DecoderConfig config;
  torch::nn::Embedding embed_tokens{nullptr};
};
TORCH_MODULE(DecoderEmbedding);

// One decoder layer: h += self_attn(input_layernorm(h));
// h += mlp(post_attention_layernorm(h)). State tuple in, state tuple out.
class DecoderBlockImpl : public torch::nn::Cloneable<DecoderBlockImpl>, public ValueLayer, public RandomFree {
 public:
  explicit DecoderBlockImpl(DecoderConfig config);
  void reset() override;
  c10::IValue forward(std::vector<c10::IValue> args, Kwargs kwargs) override;

  DecoderConfig config;
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  DecoderAttention self_attn{nullptr};
  DecoderMlp mlp{nullptr};
};
TORCH_MODULE(DecoderBlock);

// The bias-free output projection [vocab, hidden] of the head. Constructed
// with `tied`, it registers that tensor (the embedding's weight) as its
// weight, once: clones get a fresh tensor of their own (see module_layer).
class LmHeadProjectionImpl : public torch::nn::Cloneable<LmHeadProjectionImpl> {
 public:
  LmHeadProjectionImpl(int64_t vocab_size, int64_t hidden_size, double init_std,
                       at::Tensor tied = {});
  void reset() override;

  int64_t vocab_size, hidden_size;
  double init_std;
  at::Tensor tied;    // consumed by the first reset()
  at::Tensor weight;  // [vocab, hidden]
};
TORCH_MODULE(LmHeadProjection);

// Last layer: norm, then lm_head. With labels in the state, returns the
// cross-entropy (mean over non-ignored positions, 0 if there are none) as a
// 0-dim fp32 tensor, computed by chunked_cross_entropy so full logits never
// exist; without labels, returns logits [B, T, V]. Children: norm (RMSNorm),
// lm_head (LmHeadProjection; with `tied_embedding` it shares that tensor).
class LmHeadImpl : public torch::nn::Cloneable<LmHeadImpl>, public ValueLayer, public RandomFree {
 public:
  explicit LmHeadImpl(DecoderConfig config, at::Tensor tied_embedding = {});
  void reset() override;
  c10::IValue forward(std::vector<c10::IValue> args, Kwargs kwargs) override;

  DecoderConfig config;
  at::Tensor tied_embedding;  // consumed by the first reset()
  RMSNorm norm{nullptr};
  LmHeadProjection lm_head{nullptr};
};
TORCH_MODULE(LmHead);

// Cross-entropy of logits = hidden @ weight^T against labels, computed in
// chunks of `chunk_size` rows: forward keeps only the per-row log-sum-exp,
// backward recomputes each chunk's logits, so at most [chunk_size, V] logits
// exist at a time. hidden [N, D], weight [V, D] (same dtype), labels [N]
// int64 (ignore_index skipped; other values must lie in [0, V)). Logits
// are reduced in fp32. Returns a 0-dim fp32 tensor: the mean over counted
// rows (0 when none count) or, with sum_reduction, their sum. Differentiable
// in hidden and weight (first order). Throws c10::ValueError on bad shapes,
// chunk_size < 1 or an out-of-range label.
at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                 const at::Tensor& labels, int64_t chunk_size = 1024,
                                 int64_t ignore_index = -100, bool sum_reduction = false);

// embedding | num_hidden_layers blocks | head, initialized as Hugging Face
// does (normal(0, initializer_range) for linear and embedding weights, zero
// biases, ones for norms). With tie_word_embeddings the head's lm_head.weight
// is the embedding's weight tensor. Throws as DecoderConfig::validate.
torch::nn::Sequential make_decoder(const DecoderConfig& config);

// (our name, Hugging Face name) for each distinct parameter of
// make_decoder(config), in named_parameters() order: "0.embed_tokens.weight"
// -> "model.embed_tokens.weight", "<i+1>.<rest>" -> "model.layers.<i>.<rest>",
// "<L+1>.norm.weight" -> "model.norm.weight", "<L+1>.lm_head.weight" ->
// "lm_head.weight" (omitted when tied: it is the embedding's tensor).
std::vector<std::pair<std::string, std::string>> hf_parameter_names(const DecoderConfig& config);

// The loss function for RoundPipe::forward_backward over a preset called
// with labels: the head already returns the loss, so this returns `outputs`
// (and checks it is a 0-dim tensor).
LossFn preset_loss_fn();

}  // namespace roundpipe
