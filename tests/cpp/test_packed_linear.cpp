// Frozen weights kept packed (packed_linear.h): the packed buffers and the
// dequantized weights are bitwise those of the Python implementation
// (python/roundpipe/packed.py, itself bitwise bitsandbytes' for NF4 / FP4);
// a packed Projection computes with its dequantized weight, clones and
// converts without touching its codes; a LoRA run of the tiny Llama on NF4
// frozen weights trains like one on bf16 frozen weights; bad requests are
// clear errors that change nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <roundpipe/lora.h>
#include <roundpipe/optim/adam.h>
#include <roundpipe/packed_linear.h>
#include <roundpipe/presets.h>

#include "expect_error.h"
#include "models.h"

namespace roundpipe {
namespace testing {
namespace {

// 64-bit FNV-1a of a tensor's bytes (contiguous, in memory order).
uint64_t fnv1a(const at::Tensor& t) {
  const at::Tensor bytes = t.detach().contiguous().reshape({-1}).view(at::kByte);
  const uint8_t* p = bytes.data_ptr<uint8_t>();
  uint64_t h = 0xcbf29ce484222325ULL;
  for (int64_t i = 0; i < bytes.numel(); ++i) {
    h ^= p[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

// A deterministic weight [out, in] that Python builds the same way:
//   i = torch.arange(n); block = i // 64; k = (i * 37) % 101 - 50
//   mag = (1 + (block * 5) % 13) * (block % 17 != 3)    # every 17th block zero
//   w = ((k * mag).float() / 64).reshape(out, in).to(dtype)
// (integer arithmetic, exact in fp32): blocks of varied scale, zero blocks,
// a short last block and, at [131, 129], two nested blocks, the last short.
at::Tensor golden_input(int64_t out, int64_t in, at::ScalarType dtype) {
  const at::Tensor i = at::arange(out * in, at::kLong);
  const at::Tensor block = at::div(i, 64, "floor");
  const at::Tensor k = at::remainder(i * 37, 101) - 50;
  const at::Tensor mag =
      (1 + at::remainder(block * 5, 13)) * at::ne(at::remainder(block, 17), 3).to(at::kLong);
  return ((k * mag).to(at::kFloat) / 64).reshape({out, in}).to(dtype);
}

struct Golden {
  const char* format;
  at::ScalarType dtype;
  int64_t out, in;
  // (name, dtype, numel, FNV-1a of the bytes) of each buffer, in order.
  std::vector<std::tuple<std::string, at::ScalarType, int64_t, uint64_t>> buffers;
  uint64_t dequantized;  // FNV-1a of the dequantized weight
};

// Produced by python/roundpipe/packed.py (PackedLinear.from_linear of an
// nn.Linear holding golden_input's weight; named_buffers(), then
// dequantized_weight()), hashed with the same FNV-1a over the tensors' bytes.
const uint64_t kDynamicCode = 0xd677f22a96665bc4ULL;
const uint64_t kNf4Code = 0x38e10558c37c2c71ULL;
const uint64_t kFp4Code = 0x34e98e13e945d335ULL;

std::vector<Golden> golden_cases() {
  const auto u8 = at::kByte, f32 = at::kFloat;
  return {
      {"nf4",
       at::kBFloat16,
       131,
       129,
       {{"packed", u8, 8450, 0x0cf656223e7421c0ULL},
        {"scales", u8, 265, 0xa1a234d3458a9ef4ULL},
        {"nested_scales", f32, 2, 0x577ff6b41f155d59ULL},
        {"offset", f32, 1, 0x72b0e978a673f54aULL},
        {"nested_code", f32, 256, kDynamicCode},
        {"code", f32, 16, kNf4Code}},
       0x98d4e583f1b04b64ULL},
      {"nf4",
       at::kBFloat16,
       7,
       33,
       {{"packed", u8, 116, 0x7a07176531e3e227ULL},
        {"scales", u8, 4, 0x2fc42875e72f9051ULL},
        {"nested_scales", f32, 1, 0x24101c7e64e60efeULL},
        {"offset", f32, 1, 0xf71e107d28b63f2cULL},
        {"nested_code", f32, 256, kDynamicCode},
        {"code", f32, 16, kNf4Code}},
       0x771d8e3125220cd8ULL},
      {"fp4",
       at::kBFloat16,
       131,
       129,
       {{"packed", u8, 8450, 0x86987dcb9eb2499bULL},
        {"scales", u8, 265, 0xa1a234d3458a9ef4ULL},
        {"nested_scales", f32, 2, 0x577ff6b41f155d59ULL},
        {"offset", f32, 1, 0x72b0e978a673f54aULL},
        {"nested_code", f32, 256, kDynamicCode},
        {"code", f32, 16, kFp4Code}},
       0x8518c256dc2a5519ULL},
      {"fp4",
       at::kBFloat16,
       7,
       33,
       {{"packed", u8, 116, 0x6d5b6b2119109687ULL},
        {"scales", u8, 4, 0x2fc42875e72f9051ULL},
        {"nested_scales", f32, 1, 0x24101c7e64e60efeULL},
        {"offset", f32, 1, 0xf71e107d28b63f2cULL},
        {"nested_code", f32, 256, kDynamicCode},
        {"code", f32, 16, kFp4Code}},
       0x40ae67b3553fb99cULL},
      {"int8",
       at::kBFloat16,
       131,
       129,
       {{"packed", at::kChar, 131 * 129, 0xbb196ea3b2920b5dULL},
        {"row_scale", f32, 131, 0xb09009cd6187f3b5ULL}},
       0xf6287e6548b0902bULL},
      {"int8",
       at::kBFloat16,
       7,
       33,
       {{"packed", at::kChar, 7 * 33, 0x487d6ba0c06303abULL},
        {"row_scale", f32, 7, 0xcb7d0e6b68887a36ULL}},
       0xdd62015e13628133ULL},
      {"nf4",
       at::kFloat,
       131,
       129,
       {{"packed", u8, 8450, 0x68814cbe499fad1fULL},
        {"scales", u8, 265, 0x60637092b489ad04ULL},
        {"nested_scales", f32, 2, 0xbcba00c9cab246c9ULL},
        {"offset", f32, 1, 0xfbac86c8a72a7098ULL},
        {"nested_code", f32, 256, kDynamicCode},
        {"code", f32, 16, kNf4Code}},
       0xee6c190dd3f89e7cULL},
      {"nf4",
       at::kFloat,
       7,
       33,
       {{"packed", u8, 116, 0x7a07176531e3e227ULL},
        {"scales", u8, 4, 0x2fc42875e72f9051ULL},
        {"nested_scales", f32, 1, 0xf9b5427d2aea20e7ULL},
        {"offset", f32, 1, 0x4bdb907f9cb594acULL},
        {"nested_code", f32, 256, kDynamicCode},
        {"code", f32, 16, kNf4Code}},
       0xce660cabfa1cbc1cULL},
  };
}

// The weights of every block's seven projections.
int64_t projection_weights(const DecoderConfig& c) {
  const int64_t attention =
      2 * c.hidden_size * (c.num_attention_heads + c.kv_heads()) * c.head_size();
  return c.num_hidden_layers * (attention + 3 * c.hidden_size * c.intermediate_size);
}

std::vector<at::Tensor> tensors_of(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::vector<at::Tensor> out;
  for (const auto& item : named) out.push_back(item.second);
  return out;
}

TEST(PackedLinear, CodeTablesAreThePythonOnes) {
  EXPECT_EQ(fnv1a(dynamic_code()), kDynamicCode);
  EXPECT_EQ(fnv1a(four_bit_code("nf4")), kNf4Code);
  EXPECT_EQ(fnv1a(four_bit_code("fp4")), kFp4Code);
  // Readable anchors of the same tables.
  const at::Tensor map = dynamic_code();
  ASSERT_EQ(map.numel(), 256);
  EXPECT_EQ(map[0].item<float>(), -0.992968738079071f);
  EXPECT_EQ(map[255].item<float>(), 1.0f);
  EXPECT_EQ(four_bit_code("nf4")[1].item<float>(), -0.6961928009986877f);
  EXPECT_EQ(four_bit_code("fp4")[1].item<float>(), static_cast<float>(1.0 / 192));
}

// Quantizing golden_input gives Python's buffers byte for byte, and
// dequantizing them Python's weight bit for bit.
TEST(PackedLinear, PackedBuffersAndWeightsAreBitwiseThePythonOnes) {
  for (const Golden& g : golden_cases()) {
    SCOPED_TRACE(std::string(g.format) + " " + c10::toString(g.dtype) + " [" +
                 std::to_string(g.out) + ", " + std::to_string(g.in) + "]");
    const auto buffers = quantize_weight(golden_input(g.out, g.in, g.dtype), g.format);
    ASSERT_EQ(buffers.size(), g.buffers.size());
    for (size_t i = 0; i < buffers.size(); ++i) {
      const auto& [name, dtype, numel, hash] = g.buffers[i];
      const at::Tensor& t = buffers[i].second;
      EXPECT_EQ(buffers[i].first, name);
      EXPECT_EQ(t.scalar_type(), dtype) << name;
      EXPECT_EQ(t.numel(), numel) << name;
      EXPECT_EQ(fnv1a(t), hash) << name;
    }
    const at::Tensor w = dequantize_weight(g.format, tensors_of(buffers), g.out, g.in, g.dtype);
    EXPECT_EQ(w.scalar_type(), g.dtype);
    EXPECT_EQ(w.sizes(), (std::vector<int64_t>{g.out, g.in}));
    EXPECT_EQ(fnv1a(w), g.dequantized);
  }
  // A few values in the clear (Python printed them): the first packed bytes
  // and dequantized weights of nf4, bf16, [131, 129].
  const auto nf4 = quantize_weight(golden_input(131, 129, at::kBFloat16), "nf4");
  const std::vector<int64_t> first_bytes = {4, 193, 110, 41, 243, 176};
  for (size_t i = 0; i < first_bytes.size(); ++i) {
    EXPECT_EQ(nf4[0].second[i].item<int64_t>(), first_bytes[i]);
  }
  EXPECT_EQ(nf4[3].second.item<float>(), 5.125943183898926f);  // offset: the mean block maximum
  const at::Tensor w = dequantize_weight("nf4", tensors_of(nf4), 131, 129, at::kBFloat16);
  const std::vector<float> first_weights = {-0.7578125f, -0.21484375f, 0.333984375f, -0.52734375f};
  for (size_t i = 0; i < first_weights.size(); ++i) {
    EXPECT_EQ(w.reshape(-1)[i].item<float>(), first_weights[i]);
  }
}

// The round trip stays within each format's resolution: int8 within half a
// level (plus the bf16 rounding), nf4 / fp4 within the widest gap of their
// codes times the block maximum.
TEST(PackedLinear, RoundTripErrorIsBoundedByTheFormat) {
  torch::manual_seed(3);
  const at::Tensor w = torch::randn({96, 40}).to(at::kBFloat16);
  const at::Tensor wf = w.to(at::kFloat);
  {
    const auto b = quantize_weight(w, "int8");
    const at::Tensor err =
        (dequantize_weight("int8", tensors_of(b), 96, 40, at::kBFloat16).to(at::kFloat) - wf).abs();
    const at::Tensor bound = b[1].second.unsqueeze(1) * 0.5 + wf.abs() * std::pow(2.0, -8);
    EXPECT_TRUE((err <= bound).all().item<bool>());
  }
  for (const char* f : {"nf4", "fp4"}) {
    const auto b = quantize_weight(w, f);
    const at::Tensor err =
        (dequantize_weight(f, tensors_of(b), 96, 40, at::kBFloat16).to(at::kFloat) - wf).abs();
    const double widest = std::get<0>(four_bit_code(f).sort()).diff().max().item<double>();
    // Per element: its block's maximum (the double quantization perturbs it
    // by at most a few percent).
    const at::Tensor maxima =
        wf.reshape({-1, 64}).abs().amax({1}, true).expand({-1, 64}).reshape({96, 40});
    EXPECT_TRUE((err <= maxima * (widest * 0.5 + 0.05) + 1e-6).all().item<bool>()) << f;
  }
}

// A packed Projection: the weight parameter is gone, frozen parameters hold
// the quantized weight (before the adapter's, in clones too), forward is the linear of the
// dequantized weight (and the adapter), clones and dtype conversions keep the codes.
TEST(PackedLinear, ProjectionComputesWithItsDequantizedWeight) {
  torch::manual_seed(4);
  Projection p(129, 131, /*bias=*/true);
  {
    torch::NoGradGuard no_grad;
    p->weight.copy_(golden_input(131, 129, at::kFloat));
  }
  p->to(at::kBFloat16);
  p->add_adapter(4, 2.0);
  {
    torch::NoGradGuard no_grad;
    p->lora_B.normal_();  // lora_B starts at zero: make the adapter count
  }
  for (auto& t : p->parameters()) t.requires_grad_(t.is_same(p->lora_A) || t.is_same(p->lora_B));
  const auto expected = quantize_weight(golden_input(131, 129, at::kBFloat16), "nf4");
  p->pack_weight("nf4");

  EXPECT_TRUE(p->is_packed());
  EXPECT_FALSE(p->weight.defined());
  const std::vector<std::string> names = {"bias",          "packed", "scales",
                                          "nested_scales", "offset", "nested_code",
                                          "code",          "lora_A", "lora_B"};
  std::vector<std::string> params;
  for (const auto& item : p->named_parameters()) params.push_back(item.key());
  EXPECT_EQ(params, names);
  EXPECT_TRUE(p->named_buffers().is_empty());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(torch::equal(p->packed_tensors[i], expected[i].second)) << expected[i].first;
    EXPECT_FALSE(p->packed_tensors[i].requires_grad()) << expected[i].first;
  }
  EXPECT_TRUE(p->lora_A.requires_grad());
  const at::Tensor w = p->dense_weight();
  EXPECT_EQ(w.scalar_type(), at::kBFloat16);
  EXPECT_EQ(fnv1a(w), 0x98d4e583f1b04b64ULL);  // golden_cases()' nf4, bf16, [131, 129]

  const at::Tensor x = torch::randn({3, 5, 129}).to(at::kBFloat16);
  const at::Tensor want =
      at::linear(x, w, p->bias) + at::linear(at::linear(x, p->lora_A), p->lora_B) * 2.0;
  EXPECT_TRUE(torch::equal(p->forward(x), want));

  // Clones (one per device) are packed alike.
  auto clone = std::dynamic_pointer_cast<ProjectionImpl>(p->clone());
  ASSERT_TRUE(clone);
  EXPECT_TRUE(clone->is_packed());
  params.clear();
  for (const auto& item : clone->named_parameters()) params.push_back(item.key());
  EXPECT_EQ(params, names) << "a replica binds its master's parameters in order";
  EXPECT_FALSE(clone->packed_tensors[0].is_same(p->packed_tensors[0]));
  EXPECT_TRUE(torch::equal(clone->forward(x), want));

  // to(dtype) changes the computation's dtype, not the codes or scales.
  clone->to(at::kFloat);
  EXPECT_EQ(clone->packed_tensors[0].scalar_type(), at::kByte);
  EXPECT_EQ(clone->packed_tensors[2].scalar_type(), at::kFloat);
  EXPECT_EQ(clone->dense_weight().scalar_type(), at::kFloat);
  EXPECT_EQ(clone->bias.scalar_type(), at::kFloat);
  EXPECT_TRUE(torch::equal(clone->dense_weight(),
                           dequantize_weight("nf4", p->packed_tensors, 131, 129, at::kFloat)));
}

TEST(PackedLinear, BadRequestsAreClearErrorsThatChangeNothing) {
  torch::manual_seed(5);
  DecoderConfig c = tiny_llama_config();
  c.num_hidden_layers = 2;
  torch::nn::Sequential net = make_decoder(c);

  // A trained weight is never packed.
  expect_message(value_error_of([&] { pack_frozen_weights(net, "nf4"); }),
                 {"1.self_attn.q_proj.weight", "requires_grad", "apply_lora"});
  EXPECT_EQ(packed_weight_bytes(net), 0);
  Projection trained(8, 8, false);
  expect_message(value_error_of([&] { trained->pack_weight("int8"); }), {"trained", "freeze"});
  EXPECT_FALSE(trained->is_packed());

  // Unknown formats, by every entry point.
  expect_message(value_error_of([&] { pack_frozen_weights(net, "nf5"); }),
                 {"'nf5'", "nf4, fp4, int8"});
  LoraConfig lora;
  lora.frozen_weights = "q4";
  expect_message(value_error_of([&] { lora.validate(); }), {"frozen_weights", "'q4'"});
  expect_message(value_error_of([&] { apply_lora(net, lora); }), {"'q4'"});
  EXPECT_TRUE(lora_parameters(net).empty());
  expect_message(value_error_of([&] { quantize_weight(at::ones({4}), "nf4"); }), {"[out, in]"});

  // Not a decoder: nothing to pack.
  torch::nn::Sequential mlp = make_mlp();
  expect_message(value_error_of([&] { pack_frozen_weights(mlp, "nf4"); }), {"make_decoder"});

  // Packing twice.
  lora.frozen_weights = "fp4";
  lora.target_modules = {"q_proj", "down_proj"};
  EXPECT_EQ(apply_lora(net, lora), 2 * c.num_hidden_layers);
  EXPECT_EQ(packed_weight_elements(net), projection_weights(c));  // all, adapted or not
  const int64_t bytes = packed_weight_bytes(net);
  expect_message(value_error_of([&] { pack_frozen_weights(net, "int8"); }), {"packed already"});
  EXPECT_EQ(packed_weight_bytes(net), bytes);
}

// A short LoRA run of the tiny Llama (bf16, 2 CPU devices) with NF4 frozen
// weights: only the adapters train, the packed tensors live in the engine's
// one parameter slab and stay bitwise as they were, the losses are finite and within 2 % of the
// same run's on bf16 frozen weights.
TEST(PackedLinear, LoraOnNf4FrozenWeightsTrainsLikeBf16) {
  const DecoderConfig c = tiny_llama_config();
  torch::manual_seed(21);
  const at::Tensor ids = torch::randint(c.vocab_size, {6, 32});
  const at::Tensor labels = ids.roll(-1, 1);
  std::map<std::string, std::vector<double>> losses;
  for (const std::string format : {"", "nf4"}) {
    SCOPED_TRACE(format.empty() ? "bf16" : format);
    torch::manual_seed(7);
    torch::nn::Sequential net = make_decoder(c);
    net->to(at::kBFloat16);
    LoraConfig lora;
    lora.rank = 8;
    lora.target_modules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                           "gate_proj", "up_proj", "down_proj"};
    lora.frozen_weights = format;
    apply_lora(net, lora);
    std::map<std::string, at::Tensor> before;
    for (const auto& p : net->named_parameters()) {
      if (!p.value().requires_grad()) before[p.key()] = p.value().clone();
    }
    if (!format.empty()) {
      EXPECT_EQ(packed_weight_elements(net), projection_weights(c));
      // About 0.52 bytes per weight (4 bits, a byte per 64) and the code tables.
      const double per = double(packed_weight_bytes(net)) / double(packed_weight_elements(net));
      EXPECT_GT(per, 0.5);
      EXPECT_LT(per, 0.57);  // the tables (1,088 B a projection) weigh on small ones
    }

    RoundPipe model(net, RoundPipeOptions()
                             .set_max_devices(std::min<int64_t>(2, get_num_devices()))
                             .set_optim_dtype(at::kFloat));
    if (!format.empty()) {
      // Packed tensors are parameters: in the slab (one allocation, 64-byte
      // aligned, in layer order), page-locked on a GPU and uploaded with
      // the rest of a stage in one copy.
      std::set<std::pair<const uint8_t*, int64_t>> spans;
      int64_t packed_in_slab = 0;
      for (const at::Tensor& p : net->parameters()) {
        spans.emplace(static_cast<const uint8_t*>(p.data_ptr()), int64_t(p.nbytes()));
      }
      const uint8_t* first = spans.begin()->first;
      const uint8_t* end = first;
      int64_t rounded = 0;
      for (const auto& [at, bytes] : spans) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(at) % 64, 0u);
        EXPECT_GE(at, end) << "not overlapping";
        end = at + bytes;
        rounded += (bytes + 63) / 64 * 64;
      }
      EXPECT_LE(end - first, rounded) << "one allocation";
      for (const auto& item : net->named_parameters()) {
        if (item.key().find("packed") != std::string::npos) ++packed_in_slab;
      }
      EXPECT_EQ(packed_in_slab, 7 * c.num_hidden_layers);
    }
    std::vector<std::string> trained;
    for (const auto& item : model.optim_named_parameters()) trained.push_back(item.first);
    EXPECT_EQ(trained.size(), size_t(2 * 7 * c.num_hidden_layers));  // the adapters only
    optim::AdamW opt(model.optim_parameters(), optim::AdamWOptions(1e-2));
    for (int step = 0; step < 8; ++step) {
      losses[format].push_back(model
                                   .forward_backward({ids}, make_kwargs({{"labels", labels}}),
                                                     c10::IValue(), preset_loss_fn(), false,
                                                     RunConfig().num_microbatch(3))
                                   .toTensor()
                                   .item<double>());
      model.step([&] {
        opt.step();
        opt.zero_grad();
      });
    }
    model.synchronize();
    for (double l : losses[format]) EXPECT_TRUE(std::isfinite(l));
    EXPECT_LT(losses[format].back(), losses[format].front());
    for (const auto& p : net->named_parameters()) {
      if (!p.value().requires_grad()) {
        EXPECT_TRUE(torch::equal(p.value(), before.at(p.key()))) << p.key() << " changed";
      }
    }
  }
  const auto& bf16 = losses[""];
  const auto& nf4 = losses["nf4"];
  for (size_t i = 0; i < bf16.size(); ++i) {
    EXPECT_NEAR(nf4[i] / bf16[i], 1.0, 0.02)
        << "step " << i << ": nf4 " << nf4[i] << ", bf16 " << bf16[i];
  }
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
