// Frozen weights kept packed (QLoRA): the frozen projection weights of a LoRA
// decoder (lora.h) held as 4-bit or 8-bit codes plus their scales, in host
// memory and on the link, and dequantized inside the layer's forward.
//
//   roundpipe::LoraConfig lora;
//   lora.frozen_weights = "nf4";                // or "fp4", "int8"
//   roundpipe::apply_lora(net, lora);           // adapters, then packing
//
// The formats and their arithmetic are those of the Python API
// (python/roundpipe/packed.py): for the same weight the packed tensors and the
// dequantized weight are bitwise equal to its PackedLinear's.
//
// - "nf4" / "fp4": 4 bits per weight in bitsandbytes' layout (two codes per
//   byte, the first in the high nibble; blocks of 64 weights scaled by their
//   absolute maximum), with double quantization: the block maxima less their
//   mean, as 8-bit codes of bitsandbytes' dynamic map in blocks of 256.
//   Tensors, in order: "packed" uint8 [ceil(n / 2)], "scales" uint8
//   [ceil(n / 64)], "nested_scales" fp32 [ceil(n / 64 / 256)], "offset" fp32
//   [] (the mean), "nested_code" fp32 [256], "code" fp32 [16]. About 0.516
//   bytes per weight.
// - "int8": "packed" int8 [out, in] (round(w / scale), half to even) and
//   "row_scale" fp32 [out] (the row's absolute maximum / 127). About 1 byte
//   per weight.
//
// The packed tensors are frozen parameters (requires_grad false, as
// bitsandbytes' Params4bit), so the engine keeps them in its host slab,
// page-locked like every parameter, and uploads them with the stage's other
// parameters in one copy; no optimizer copy is made for them.
//
// Dequantization is the code's fp32 value times the block's fp32 scale,
// rounded once to the weight's dtype (what bitsandbytes' dequantize_4bit
// computes).
//
// Thread-safety: the functions are pure but for pack_frozen_weights, which
// changes the Sequential it is given (thread-compatible).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace roundpipe {

// "nf4", "fp4", "int8".
const std::vector<std::string>& frozen_weight_formats();

// Throws c10::ValueError naming `who` and the known formats unless `format`
// is one of frozen_weight_formats().
void check_frozen_weight_format(const std::string& format, const std::string& who);

// The 16 fp32 levels of "nf4" or "fp4", indexed by the 4-bit code.
at::Tensor four_bit_code(const std::string& format);

// bitsandbytes' signed 8-bit dynamic map: 256 sorted fp32 values.
at::Tensor dynamic_code();

// The packed tensors (names and tensors, in the order above) of `weight` [out, in]
// (any floating dtype, on the CPU) packed in `format`. Throws c10::ValueError
// for an unknown format or a weight that is not a floating 2-d tensor.
std::vector<std::pair<std::string, at::Tensor>> quantize_weight(const at::Tensor& weight,
                                                                const std::string& format);

// The weight [out, in] in `dtype` from `tensors` (in quantize_weight's order,
// on any one device).
at::Tensor dequantize_weight(const std::string& format, const std::vector<at::Tensor>& tensors,
                             int64_t out_features, int64_t in_features, at::ScalarType dtype);

// Replaces the weight of every Projection of the decoder blocks of `decoder`
// (a Sequential made by make_decoder) by its packed tensors, one projection at
// a time (its full-precision weight is released as its packed form is made).
// The embedding, the head and every bias stay as they are. Call after the
// dtype conversion (the dequantized weights take the weights' dtype) and
// before wrapping in a RoundPipe. Returns the number of weights packed.
// Throws c10::ValueError, changing nothing, for an unknown format, a decoder
// that is not a preset, a trained (requires_grad) weight, or one already
// packed.
int64_t pack_frozen_weights(torch::nn::Sequential& decoder, const std::string& format);

// Bytes of the packed tensors of `decoder`'s projections (0 when none).
int64_t packed_weight_bytes(const torch::nn::Sequential& decoder);

// Elements of the weights that are packed (their [out, in] sizes summed).
int64_t packed_weight_elements(const torch::nn::Sequential& decoder);

// The packed weights dequantized, by parameter name ("1.self_attn.q_proj.weight",
// ...), in named_modules() order: what a full-precision export writes for them.
std::vector<std::pair<std::string, at::Tensor>> dequantized_frozen_weights(
    const torch::nn::Sequential& decoder);

}  // namespace roundpipe
