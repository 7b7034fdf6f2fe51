// Llama / Qwen3 presets: config parsing, the layers against an independent
// functional implementation written here from Hugging Face names, the
// chunked loss against full cross-entropy, and the preset under RoundPipe.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>

#include <roundpipe/presets.h>

#include "models.h"
#include "preset_reference.h"

namespace roundpipe {
namespace testing {
namespace {

const char* kLlamaJson = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
  "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
  "num_attention_heads": 32, "num_key_value_heads": 4, "rms_norm_eps": 1e-05,
  "rope_theta": 500000.0, "max_position_embeddings": 2048, "tie_word_embeddings": false,
  "hidden_act": "silu", "torch_dtype": "bfloat16", "attention_bias": false,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}})";

const char* kQwen3Json = R"({
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
  "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
  "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000, "max_position_embeddings": 40960, "tie_word_embeddings": true,
  "hidden_act": "silu", "torch_dtype": "bfloat16", "use_sliding_window": false,
  "sliding_window": null, "rope_scaling": null, "attention_bias": false})";

// ---- Configs ----

TEST(Presets, ParsesLlamaConfigJson) {
  DecoderConfig c = from_hf_config_json(kLlamaJson);
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.num_hidden_layers, 22);
  EXPECT_EQ(c.kv_heads(), 4);
  EXPECT_EQ(c.head_size(), 64);
  EXPECT_FALSE(c.qk_norm());
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope_scaling.rope_type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_EQ(c.torch_dtype, at::kBFloat16);
}

TEST(Presets, ParsesQwen3ConfigJson) {
  DecoderConfig c = from_hf_config_json(kQwen3Json);
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_TRUE(c.qk_norm());
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.head_size(), 128);  // explicit, not hidden / heads (64)
  EXPECT_EQ(c.kv_heads(), 8);
  EXPECT_EQ(c.rope_scaling.rope_type, "default");
  EXPECT_EQ(c.max_position_embeddings, 40960);
}

// transformers >= 5 writes rope_theta and the scaling as one "rope_parameters"
// object, and "dtype" for "torch_dtype".
TEST(Presets, ParsesRopeParametersOfNewerConfigs) {
  const auto c = from_hf_config_json(R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "dtype": "bfloat16",
    "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}})");
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.rope_type, "linear");
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 2.0);
  EXPECT_EQ(c.torch_dtype, at::kBFloat16);
}

TEST(Presets, LoadsConfigFromFile) {
  const std::string path = ::testing::TempDir() + "roundpipe_presets_config.json";
  std::ofstream(path) << kQwen3Json;
  EXPECT_EQ(load_hf_config(path).hidden_size, 1024);
  std::remove(path.c_str());
  EXPECT_THROW(load_hf_config(path), c10::ValueError);
}

void expect_rejected(const std::string& text, const std::string& fragment) {
  try {
    from_hf_config_json(text);
    ADD_FAILURE() << "accepted: " << text;
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(Presets, RejectsInvalidConfigs) {
  const std::string base =
      R"("model_type": "llama", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 8,
                              "num_hidden_layers": 1)";
  expect_rejected("{" + base + "}", "num_attention_heads");  // missing
  expect_rejected(R"({"vocab_size": 10})", "model_type");
  expect_rejected("{" + base + R"(, "num_attention_heads": 3})", "multiple of num_attention_heads");
  expect_rejected("{" + base + R"(, "num_attention_heads": 4, "num_key_value_heads": 3})",
                  "num_key_value_heads");
  expect_rejected("{" + base + R"(, "num_attention_heads": "4"})", "must be an integer");
  expect_rejected("{" + base + R"(, "num_attention_heads": 4, "hidden_act": "gelu"})",
                  "hidden_act");
  expect_rejected(R"({"model_type": "gpt2", "vocab_size": 10})", "not supported");
  expect_rejected(
      "{" + base + R"(, "num_attention_heads": 4, "rope_scaling": {"rope_type": "yarn"}})", "yarn");
  expect_rejected("{" + base + R"(, "num_attention_heads": 0})", "positive");
  expect_rejected("{not json", "not valid JSON");
  expect_rejected("{" + base + R"(, "num_attention_heads": 4, "head_dim": 3})", "even");
  DecoderConfig ok = from_hf_config_json("{" + base + R"(, "num_attention_heads": 4})");
  EXPECT_EQ(ok.kv_heads(), 4);
  EXPECT_EQ(ok.head_size(), 4);
}

TEST(Presets, TinyConfigsAreValid) {
  EXPECT_NO_THROW(tiny_llama_config().validate());
  EXPECT_NO_THROW(tiny_qwen3_config().validate());
  EXPECT_EQ(tiny_llama_config().vocab_size, 256);
  EXPECT_TRUE(tiny_qwen3_config().qk_norm());
}

TEST(Presets, RotaryTables) {
  DecoderConfig c = tiny_llama_config();
  c.head_dim = 16;
  auto [cos, sin] = rotary_cos_sin(c, 5);
  ASSERT_EQ(cos.sizes(), at::IntArrayRef({5, 16}));
  for (int64_t i = 0; i < 8; ++i) {
    const double inv = 1.0 / std::pow(c.rope_theta, double(2 * i) / 16.0);
    EXPECT_NEAR(cos[3][i].item<double>(), std::cos(3 * inv), 1e-6);
    EXPECT_NEAR(sin[3][i + 8].item<double>(), std::sin(3 * inv), 1e-6);
  }
  // Llama 3 scaling: short wavelengths unchanged, long ones divided by factor.
  DecoderConfig s = from_hf_config_json(kLlamaJson);
  s.rope_scaling.original_max_position_embeddings = 64;
  s.head_dim = 16;
  s.rope_theta = 10000.0;
  DecoderConfig plain = s;
  plain.rope_scaling = RopeScaling();
  const int64_t pos = 1;
  auto scaled = rotary_cos_sin(s, pos + 1), base = rotary_cos_sin(plain, pos + 1);
  at::Tensor f_scaled = torch::atan2(scaled.second[pos], scaled.first[pos]).narrow(0, 0, 8);
  at::Tensor f_base = torch::atan2(base.second[pos], base.first[pos]).narrow(0, 0, 8);
  EXPECT_NEAR(f_scaled[0].item<double>(), f_base[0].item<double>(), 1e-6);  // wavelength 2 pi < 16
  EXPECT_NEAR(f_scaled[7].item<double>(), f_base[7].item<double>() / 32.0,
              1e-6);  // wavelength > 64
}

// ---- The model ----

TEST(Presets, LayoutShapesAndLoss) {
  torch::manual_seed(0);
  DecoderConfig c = small_config("llama", false);
  torch::nn::Sequential net = make_decoder(c);
  ASSERT_EQ(net->size(), size_t(c.num_hidden_layers + 2));
  at::Tensor ids = torch::randint(c.vocab_size, {3, 5});
  at::Tensor logits = run_plain(net, {ids}).toTensor();
  EXPECT_EQ(logits.sizes(), at::IntArrayRef({3, 5, c.vocab_size}));
  at::Tensor labels = torch::randint(c.vocab_size, {3, 5});
  auto* embed = dynamic_cast<ValueLayer*>(net[0].get());
  c10::IValue state = embed->forward({ids}, make_kwargs({{"labels", labels}}));
  for (size_t i = 1; i < net->size(); ++i)
    state = dynamic_cast<ValueLayer*>(net[i].get())->forward({state}, make_kwargs());
  at::Tensor loss = state.toTensor();
  EXPECT_EQ(loss.dim(), 0);
  EXPECT_NEAR(loss.item<double>(), full_loss(logits, labels).item<double>(),
              1e-5 * loss.item<double>());
  // Labels given positionally work the same.
  at::Tensor loss2 = run_plain(net, {ids, labels}).toTensor();
  EXPECT_DOUBLE_EQ(loss2.item<double>(), loss.item<double>());
  EXPECT_THROW(run_plain(net, {ids, torch::randint(5, {3, 4})}), c10::ValueError);
}

// The default tiny presets at full sequence length: a near-uniform initial
// loss (log 256), finite gradients, and a bf16 run.
TEST(Presets, TinyPresetsRun) {
  for (const DecoderConfig& c : {tiny_llama_config(), tiny_qwen3_config()}) {
    torch::manual_seed(6);
    torch::nn::Sequential net = make_decoder(c);
    at::Tensor ids = torch::randint(c.vocab_size, {2, c.max_position_embeddings});
    at::Tensor labels = ids.roll(-1, 1);
    at::Tensor loss = run_plain(net, {ids, labels}).toTensor();
    EXPECT_NEAR(loss.item<double>(), std::log(256.0), 0.1) << c.model_type;
    loss.backward();
    for (const auto& p : net->named_parameters())
      EXPECT_TRUE(p.value().grad().isfinite().all().item<bool>()) << p.key();
    net->to(torch::kBFloat16);
    at::Tensor bf16_loss = run_plain(net, {ids, labels}).toTensor();
    EXPECT_EQ(bf16_loss.scalar_type(), torch::kFloat);
    EXPECT_NEAR(bf16_loss.item<double>(), loss.item<double>(), 0.05) << c.model_type;
  }
}

TEST(Presets, CausalMasking) {
  for (const char* type : {"llama", "qwen3"}) {
    torch::manual_seed(1);
    DecoderConfig c = small_config(type, false);
    torch::nn::Sequential net = make_decoder(c);
    at::Tensor ids = torch::randint(c.vocab_size, {2, 9});
    at::Tensor changed = ids.clone();
    changed.select(1, 6).fill_(0).add_(ids.select(1, 6).add(1).remainder(c.vocab_size));
    at::Tensor a = run_plain(net, {ids}).toTensor(), b = run_plain(net, {changed}).toTensor();
    EXPECT_TRUE(torch::equal(a.narrow(1, 0, 6), b.narrow(1, 0, 6))) << type;
    EXPECT_FALSE(torch::allclose(a.narrow(1, 6, 3), b.narrow(1, 6, 3))) << type;
  }
}

// Every preset's logits, loss and every gradient against the reference.
TEST(Presets, MatchesIndependentImplementation) {
  for (const char* type : {"llama", "qwen3"}) {
    for (bool tied : {false, true}) {
      SCOPED_TRACE(std::string(type) + (tied ? " tied" : " untied"));
      torch::manual_seed(2);
      DecoderConfig c = small_config(type, tied);
      c.attention_bias = tied;  // both with and without biases
      torch::nn::Sequential net = make_decoder(c);
      // Perturb the norms so that they matter.
      {
        torch::NoGradGuard no_grad;
        for (auto& p : net->named_parameters())
          if (p.key().find("norm") != std::string::npos ||
              p.key().find("bias") != std::string::npos)
            p.value().add_(0.1 * torch::randn_like(p.value()));
      }
      std::map<std::string, at::Tensor> w = hf_weights(c, net);
      at::Tensor ids = torch::randint(c.vocab_size, {3, 6}),
                 labels = torch::randint(c.vocab_size, {3, 6});
      labels[0][2] = -100;

      at::Tensor ref_logits = reference_logits(c, w, ids);
      at::Tensor ref_loss = full_loss(ref_logits, labels);
      ref_loss.backward();
      expect_close(run_plain(net, {ids}).toTensor(), ref_logits.detach(), 1e-5, "logits");
      at::Tensor loss = run_plain(net, {ids, labels}).toTensor();
      EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5 * ref_loss.item<double>());
      loss.backward();
      auto params = net->named_parameters();
      for (const auto& [ours, hf] : hf_parameter_names(c)) {
        ASSERT_TRUE(params[ours].grad().defined()) << ours;
        expect_close(params[ours].grad(), w.at(hf).grad(), 1e-5, "grad of " + hf);
      }
    }
  }
}

// With as many kv heads as query heads, grouped-query attention is plain
// multi-head attention: a GQA model equals the MHA model whose k/v
// projections repeat each kv head for its group.
TEST(Presets, GroupedQueryAttentionEqualsRepeatedMultiHead) {
  torch::manual_seed(3);
  DecoderConfig gqa = small_config("qwen3", false), mha = gqa;
  mha.num_key_value_heads = mha.num_attention_heads;
  torch::nn::Sequential a = make_decoder(gqa), b = make_decoder(mha);
  const int64_t rep = gqa.num_attention_heads / gqa.kv_heads(), hd = gqa.head_size();
  {
    torch::NoGradGuard no_grad;
    auto pa = a->named_parameters(), pb = b->named_parameters();
    for (const auto& item : pa) {
      at::Tensor src = item.value();
      const std::string& name = item.key();
      if (name.find("k_proj") != std::string::npos || name.find("v_proj") != std::string::npos) {
        src =
            src.view({gqa.kv_heads(), hd, -1}).repeat_interleave(rep, 0).reshape(pb[name].sizes());
      }
      pb[name].copy_(src);
    }
  }
  at::Tensor ids = torch::randint(gqa.vocab_size, {2, 7});
  expect_close(run_plain(b, {ids}).toTensor(), run_plain(a, {ids}).toTensor(), 1e-5, "logits");
}

TEST(Presets, TiedHeadSharesTheEmbeddingWeight) {
  torch::nn::Sequential tied = make_decoder(small_config("qwen3", true));
  torch::nn::Sequential untied = make_decoder(small_config("qwen3", false));
  auto head_of = [](torch::nn::Sequential& s) {
    return s[s->size() - 1]->named_parameters()["lm_head.weight"];
  };
  auto embed_of = [](torch::nn::Sequential& s) {
    return s[0]->named_parameters()["embed_tokens.weight"];
  };
  EXPECT_TRUE(head_of(tied).is_same(embed_of(tied)));
  EXPECT_FALSE(head_of(untied).is_same(embed_of(untied)));
}

TEST(Presets, HfNamesCoverEveryParameterOnce) {
  for (const char* type : {"llama", "qwen3"}) {
    for (bool tied : {false, true}) {
      DecoderConfig c = small_config(type, tied);
      torch::nn::Sequential net = make_decoder(c);
      auto names = hf_parameter_names(c);
      auto params = net->named_parameters();
      std::set<const c10::TensorImpl*> distinct, mapped;
      for (const auto& p : params) distinct.insert(p.value().unsafeGetTensorImpl());
      std::set<std::string> hf;
      for (const auto& [ours, name] : names) {
        ASSERT_TRUE(params.contains(ours)) << ours;
        EXPECT_TRUE(mapped.insert(params[ours].unsafeGetTensorImpl()).second) << ours;
        EXPECT_TRUE(hf.insert(name).second) << name;
      }
      EXPECT_EQ(mapped, distinct);
      const size_t per_layer = 9 + (c.qk_norm() ? 2 : 0);
      EXPECT_EQ(names.size(), 2 + (tied ? 0 : 1) + per_layer * c.num_hidden_layers);
      for (const char* n :
           {"model.embed_tokens.weight", "model.norm.weight",
            "model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.1.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight"})
        EXPECT_EQ(hf.count(n), 1u) << n;
      EXPECT_EQ(hf.count("lm_head.weight"), tied ? 0u : 1u);
      EXPECT_EQ(hf.count("model.layers.1.self_attn.k_norm.weight"), c.qk_norm() ? 1u : 0u);
    }
  }
}

// ---- Chunked loss ----

TEST(Presets, ChunkedLossEqualsFullCrossEntropy) {
  torch::manual_seed(4);
  const int64_t n = 23, d = 12, v = 31;
  at::Tensor hidden = torch::randn({n, d}), weight = torch::randn({v, d}) * 0.5;
  at::Tensor labels = torch::randint(v, {n});
  labels[3] = -100;
  labels[17] = -100;
  for (bool sum : {false, true}) {
    at::Tensor h_ref = hidden.clone().requires_grad_(), w_ref = weight.clone().requires_grad_();
    at::Tensor ref = torch::nn::functional::cross_entropy(
        h_ref.matmul(w_ref.t()), labels,
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(
            sum ? torch::nn::functional::CrossEntropyFuncOptions::reduction_t(torch::kSum)
                : torch::nn::functional::CrossEntropyFuncOptions::reduction_t(torch::kMean)));
    (ref * 1.7).backward();
    for (int64_t chunk : {1, 4, 7, 23, 1024}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk) + (sum ? " sum" : " mean"));
      at::Tensor h = hidden.clone().requires_grad_(), w = weight.clone().requires_grad_();
      at::Tensor loss = chunked_cross_entropy(h, w, labels, chunk, -100, sum);
      EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5 * ref.item<double>());
      (loss * 1.7).backward();
      expect_close(h.grad(), h_ref.grad(), 1e-5, "grad of hidden");
      expect_close(w.grad(), w_ref.grad(), 1e-5, "grad of weight");
    }
  }
}

TEST(Presets, ChunkedLossEdgeCases) {
  at::Tensor h = torch::randn({4, 3}).requires_grad_(), w = torch::randn({5, 3});
  at::Tensor loss = chunked_cross_entropy(h, w, torch::full({4}, -100, torch::kLong), 2);
  EXPECT_EQ(loss.item<double>(), 0.0);
  loss.backward();
  EXPECT_EQ(h.grad().abs().sum().item<double>(), 0.0);
  EXPECT_THROW(chunked_cross_entropy(h, w, torch::full({4}, 5, torch::kLong), 2), c10::ValueError);
  EXPECT_THROW(chunked_cross_entropy(h, w, torch::zeros({4}, torch::kLong), 0), c10::ValueError);
  EXPECT_THROW(chunked_cross_entropy(h, w, torch::zeros({3}, torch::kLong), 2), c10::ValueError);
}

// ---- Under RoundPipe ----

TEST(Presets, RoundPipeMatchesPlainSequential) {
  for (int64_t devices : {1, 2, 3})
    for (const char* type : {"llama", "qwen3"}) {
      const bool tied = std::string(type) == "qwen3";
      SCOPED_TRACE(std::string(type) + " on " + std::to_string(devices) + " devices");
      torch::manual_seed(5);
      DecoderConfig c = small_config(type, tied);
      torch::nn::Sequential net = make_decoder(c), ref = make_decoder(c);
      {
        torch::NoGradGuard no_grad;
        auto src = net->named_parameters(), dst = ref->named_parameters();
        for (const auto& item : src) dst[item.key()].copy_(item.value());
      }
      RoundPipe model(
          net,
          RoundPipeOptions().set_max_devices(std::min(devices, get_num_devices())).set_name(type));
      const int64_t microbatches = 3;
      RunConfig cfg = RunConfig().num_microbatch(microbatches);
      at::Tensor ids = torch::randint(c.vocab_size, {5, 8}),
                 labels = torch::randint(c.vocab_size, {5, 8});
      labels[1][3] = -100;
      double ref_loss = 0;
      auto xs = ids.tensor_split(microbatches), ys = labels.tensor_split(microbatches);
      for (int64_t m = 0; m < microbatches; ++m) {
        at::Tensor l = run_plain(ref, {xs[m], ys[m]}).toTensor();
        l.backward();
        ref_loss += l.item<double>();
      }
      const double loss = model
                              .forward_backward({ids}, make_kwargs({{"labels", labels}}),
                                                c10::IValue(), preset_loss_fn(), false, cfg)
                              .toTensor()
                              .item<double>();
      EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss));
      model.synchronize();
      expect_all_close(grads_of(net->parameters()), grads_of(ref->parameters()), 1e-5, "gradients");
      // Logits through forward() without labels.
      torch::NoGradGuard no_grad;
      at::Tensor logits = model.forward({ids}, make_kwargs(), cfg).toTensor();
      expect_close(logits, run_plain(ref, {ids}).toTensor(), 1e-5, "logits");
    }
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
