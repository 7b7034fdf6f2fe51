// Frozen weights kept packed (packed_linear.h): NF4 / FP4 with double
// quantization and int8 per row. Every step is the torch operation
// python/roundpipe/packed.py performs, in the same order and dtypes, so the
// packed tensors and the dequantized weights are bitwise the Python ones.
#include "roundpipe/packed_linear.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/utils.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "roundpipe/presets.h"

namespace roundpipe {
namespace {

constexpr int64_t kBlock = 64;         // weights per 4-bit block
constexpr int64_t kNestedBlock = 256;  // block maxima per block of the double quantization

// The 16 levels of NF4 (the normal-float code of QLoRA), as packed.py lists them.
constexpr double kNf4[16] = {-1.0,
                             -0.6961928009986877,
                             -0.5250730514526367,
                             -0.39491748809814453,
                             -0.28444138169288635,
                             -0.18477343022823334,
                             -0.09105003625154495,
                             0.0,
                             0.07958029955625534,
                             0.16093020141124725,
                             0.24611230194568634,
                             0.33791524171829224,
                             0.44070982933044434,
                             0.5626170039176941,
                             0.7229568362236023,
                             1.0};
// bitsandbytes' FP4 (1 sign, 2 exponent, 1 mantissa bits), normalized to 1.
constexpr double kFp4[16] = {0.0,      1.0 / 192, 2.0 / 3,  1.0,        1.0 / 3,  1.0 / 2,
                             1.0 / 6,  1.0 / 4,   0.0,      -1.0 / 192, -2.0 / 3, -1.0,
                             -1.0 / 3, -1.0 / 2,  -1.0 / 6, -1.0 / 4};

bool is_four_bit(const std::string& format) { return format == "nf4" || format == "fp4"; }

// Absolute maximum of each block of `flat` (the last one may be short).
at::Tensor block_scales(const at::Tensor& flat, int64_t block) {
  const int64_t n = flat.numel();
  const int64_t full = n - n % block;
  at::Tensor maxima = flat.slice(0, 0, full).reshape({-1, block}).abs().amax({1});
  if (full < n) maxima = at::cat({maxima, flat.slice(0, full).abs().amax().reshape({1})});
  return maxima;
}

// Each block's scale repeated over its elements, n in all.
at::Tensor expand(const at::Tensor& scales, int64_t n, int64_t block) {
  return scales.repeat_interleave(block).slice(0, 0, n);
}

// Index of the nearest level of the sorted `code` for each value.
at::Tensor nearest(const at::Tensor& values, const at::Tensor& code) {
  const at::Tensor bounds = (code.slice(0, 0, -1) + code.slice(0, 1)) / 2;
  return at::bucketize(values, bounds);
}

at::Tensor clamp_tiny(const at::Tensor& t) { return at::clamp(t, 1e-38, std::nullopt); }

std::vector<std::pair<std::string, at::Tensor>> quantize_4bit(const at::Tensor& weight,
                                                              const std::string& format) {
  const at::Tensor flat = weight.detach().reshape(-1).to(at::kFloat);
  const int64_t n = flat.numel();
  const at::Tensor maxima = block_scales(flat, kBlock);
  const at::Tensor scaled = at::clamp(flat / expand(clamp_tiny(maxima), n, kBlock), -1, 1);
  const at::Tensor code = four_bit_code(format);
  const at::Tensor order = at::argsort(code, /*stable=*/true);
  at::Tensor codes =
      order.index_select(0, nearest(scaled, code.index_select(0, order))).to(at::kByte);
  if (n % 2) codes = at::cat({codes, at::zeros({1}, codes.options())});
  const at::Tensor packed =
      at::bitwise_or(at::bitwise_left_shift(codes.slice(0, 0, std::nullopt, 2), 4),
                     codes.slice(0, 1, std::nullopt, 2));
  const at::Tensor offset = maxima.mean();
  const at::Tensor centred = maxima - offset;
  const at::Tensor nested = block_scales(centred, kNestedBlock);
  const at::Tensor q =
      nearest(at::clamp(centred / expand(clamp_tiny(nested), centred.numel(), kNestedBlock), -1, 1),
              dynamic_code())
          .to(at::kByte);
  return {{"packed", packed},
          {"scales", q},
          {"nested_scales", nested},
          {"offset", offset},
          {"nested_code", dynamic_code()},
          {"code", code}};
}

std::vector<std::pair<std::string, at::Tensor>> quantize_int8(const at::Tensor& weight) {
  const at::Tensor w = weight.detach().to(at::kFloat);
  const at::Tensor scale = clamp_tiny(w.abs().amax({1})) / 127;
  const at::Tensor q = at::clamp(at::round(w / scale.unsqueeze(1)), -127, 127).to(at::kChar);
  return {{"packed", q}, {"row_scale", scale}};
}

// Every Projection of `decoder` with its module name ("1.self_attn.q_proj").
std::vector<std::pair<std::string, ProjectionImpl*>> projections(
    const torch::nn::Sequential& decoder) {
  std::vector<std::pair<std::string, ProjectionImpl*>> out;
  for (const auto& item : decoder->named_modules()) {
    if (auto* p = item.value()->as<ProjectionImpl>()) out.emplace_back(item.key(), p);
  }
  return out;
}

}  // namespace

const std::vector<std::string>& frozen_weight_formats() {
  static const std::vector<std::string> formats = {"nf4", "fp4", "int8"};
  return formats;
}

void check_frozen_weight_format(const std::string& format, const std::string& who) {
  for (const std::string& known : frozen_weight_formats()) {
    if (format == known) return;
  }
  TORCH_CHECK_VALUE(false, who, ": unknown frozen weight format '", format,
                    "' (known: nf4, fp4, int8)");
}

at::Tensor four_bit_code(const std::string& format) {
  TORCH_CHECK_VALUE(is_four_bit(format), "four_bit_code: format must be nf4 or fp4, got '", format,
                    "'");
  const double* levels = format == "nf4" ? kNf4 : kFp4;
  return at::tensor(std::vector<float>(levels, levels + 16));
}

at::Tensor dynamic_code() {
  // For exponent e = 0..6, 2^e fractions (the midpoints of 2^e + 1 points
  // evenly spaced over [0.1, 1]) times 10^(e - 6), both signs; then 0 and 1.
  std::vector<at::Tensor> values;
  for (int64_t e = 0; e < 7; ++e) {
    const at::Tensor points = at::linspace(0.1, 1, (int64_t{1} << e) + 1, at::kFloat);
    const at::Tensor mids = (points.slice(0, 0, -1) + points.slice(0, 1)) / 2.0;
    const double scale = std::pow(10.0, double(e - 6));
    values.push_back(mids * scale);
    values.push_back(mids * -scale);
  }
  values.push_back(at::tensor({0.0f, 1.0f}));
  return std::get<0>(at::sort(at::cat(values)));
}

std::vector<std::pair<std::string, at::Tensor>> quantize_weight(const at::Tensor& weight,
                                                                const std::string& format) {
  check_frozen_weight_format(format, "quantize_weight");
  TORCH_CHECK_VALUE(
      weight.defined() && weight.dim() == 2 && at::isFloatingType(weight.scalar_type()),
      "quantize_weight: expects a floating-point weight [out, in], got ",
      weight.defined() ? weight.toString() + " of shape " + c10::str(weight.sizes())
                       : std::string("an undefined tensor"));
  torch::NoGradGuard no_grad;
  return is_four_bit(format) ? quantize_4bit(weight, format) : quantize_int8(weight);
}

at::Tensor dequantize_weight(const std::string& format, const std::vector<at::Tensor>& tensors,
                             int64_t out_features, int64_t in_features, at::ScalarType dtype) {
  check_frozen_weight_format(format, "dequantize_weight");
  if (format == "int8") {
    TORCH_CHECK_VALUE(tensors.size() == 2, "dequantize_weight: int8 has 2 packed tensors, got ",
                      tensors.size());
    return (tensors[0].to(at::kFloat) * tensors[1].unsqueeze(1)).to(dtype);
  }
  TORCH_CHECK_VALUE(tensors.size() == 6, "dequantize_weight: ", format,
                    " has 6 packed tensors, got ", tensors.size());
  const at::Tensor &packed = tensors[0], &scales = tensors[1], &nested = tensors[2],
                   &offset = tensors[3], &nested_code = tensors[4], &code = tensors[5];
  const int64_t n = out_features * in_features;
  const at::Tensor maxima = nested_code.index_select(0, scales.to(at::kLong)) *
                                expand(nested, scales.numel(), kNestedBlock) +
                            offset;
  const at::Tensor codes =
      at::stack({at::bitwise_right_shift(packed, 4), at::bitwise_and(packed, 0xF)}, 1)
          .reshape(-1)
          .slice(0, 0, n);
  const at::Tensor values = code.index_select(0, codes.to(at::kLong)) * expand(maxima, n, kBlock);
  return values.reshape({out_features, in_features}).to(dtype);
}

int64_t pack_frozen_weights(torch::nn::Sequential& decoder, const std::string& format) {
  check_frozen_weight_format(format, "pack_frozen_weights");
  TORCH_CHECK_VALUE(!decoder.is_empty(),
                    "pack_frozen_weights: the Sequential is a null holder; pass one made by "
                    "make_decoder");
  const auto targets = projections(decoder);
  TORCH_CHECK_VALUE(!targets.empty(),
                    "pack_frozen_weights: the Sequential has no projection to pack; pass one made "
                    "by make_decoder");
  // Check everything before changing anything.
  for (const auto& [name, p] : targets) {
    TORCH_CHECK_VALUE(!p->is_packed(), "pack_frozen_weights: ", name, ".weight is packed already (",
                      p->packed_format, ")");
    TORCH_CHECK_VALUE(!p->weight.requires_grad(), "pack_frozen_weights: ", name,
                      ".weight is trained (requires_grad true), and only frozen weights are "
                      "packed: add LoRA adapters first (apply_lora freezes every base weight), or "
                      "leave the weights unpacked");
  }
  for (const auto& [name, p] : targets) p->pack_weight(format);
  return static_cast<int64_t>(targets.size());
}

int64_t packed_weight_bytes(const torch::nn::Sequential& decoder) {
  int64_t bytes = 0;
  for (const auto& [name, p] : projections(decoder)) {
    for (const at::Tensor& b : p->packed_tensors) bytes += b.numel() * int64_t(b.element_size());
  }
  return bytes;
}

int64_t packed_weight_elements(const torch::nn::Sequential& decoder) {
  int64_t n = 0;
  for (const auto& [name, p] : projections(decoder)) {
    if (p->is_packed()) n += p->out_features * p->in_features;
  }
  return n;
}

std::vector<std::pair<std::string, at::Tensor>> dequantized_frozen_weights(
    const torch::nn::Sequential& decoder) {
  torch::NoGradGuard no_grad;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, p] : projections(decoder)) {
    if (p->is_packed()) out.emplace_back(name + ".weight", p->dense_weight());
  }
  return out;
}

}  // namespace roundpipe
