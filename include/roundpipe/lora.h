// LoRA (low-rank adaptation) for the Llama / Qwen3 presets (presets.h).
//
//   torch::nn::Sequential net = roundpipe::make_decoder(cfg);
//   // ... load the base weights ...
//   roundpipe::apply_lora(net, roundpipe::LoraConfig());   // before RoundPipe
//   roundpipe::RoundPipe model(net);
//   roundpipe::optim::AdamW opt(model.optim_parameters());  // the adapters only
//
// Each adapted projection computes (as PEFT's LoRA Linear, without dropout)
//   y = x @ W^T (+ b) + scaling * (x @ A^T) @ B^T,   scaling = alpha / rank,
// with A [rank, in] initialized kaiming-uniform (a = sqrt(5)) like
// nn.Linear's weight and B [out, rank] zeros, so the adapted model starts
// equal to the base model. Every other parameter, the adapted projections'
// own weights and biases included, is frozen (requires_grad false): RoundPipe
// keeps no optimizer copy and computes no gradient for it.
//
// The adapters are parameters named "<layer>.self_attn.q_proj.lora_A",
// "<layer>.mlp.down_proj.lora_B", ...; their dtype and device are those of
// the projection's weight. hf_parameter_names lists base parameters only.
//
// Thread-safety: LoraConfig is a value; apply_lora and lora_parameters are
// thread-compatible with the Sequential they are given.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace roundpipe {

struct LoraConfig {
  int64_t rank = 8;     // r
  double alpha = 16.0;  // scaling = alpha / rank
  // Any of q_proj, k_proj, v_proj, o_proj (attention), gate_proj, up_proj,
  // down_proj (MLP). Duplicates are ignored.
  std::vector<std::string> target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  // "" keeps the frozen projection weights in the model's dtype; "nf4", "fp4"
  // or "int8" packs them (packed_linear.h) once the adapters are added. The
  // embedding and the head stay in the model's dtype.
  std::string frozen_weights;

  // Throws c10::ValueError naming the problem: rank < 1, alpha <= 0 (or not
  // finite), an empty target_modules, an unknown module name, or an unknown
  // frozen_weights format.
  void validate() const;
};

// Adds an adapter to each projection named in config.target_modules of every
// decoder block of `decoder`, a Sequential made by make_decoder, and freezes
// every other parameter (requires_grad false), the base weights of the
// adapted projections included; with config.frozen_weights set, then packs
// every projection's weight (pack_frozen_weights, packed_linear.h: after the
// dtype conversion, for the dequantized weights take the weights' dtype). Call before wrapping the
// Sequential in a RoundPipe (which reads requires_grad when it is constructed). Returns the number
// of adapted projections (num_hidden_layers * distinct targets). Throws c10::ValueError, changing
// nothing, when the config is invalid, when `decoder` is not a preset (embedding | blocks | head),
// or when it already has adapters (apply_lora called twice).
int64_t apply_lora(torch::nn::Sequential& decoder, const LoraConfig& config);

// The adapter tensors of `decoder` (the parameters themselves, not copies) with
// their names ("1.self_attn.q_proj.lora_A", ...), in named_parameters() order.
// Empty when it has none.
std::vector<std::pair<std::string, at::Tensor>> lora_parameters(
    const torch::nn::Sequential& decoder);

}  // namespace roundpipe
