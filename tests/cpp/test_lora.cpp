// LoRA on the Llama / Qwen3 presets: the adapted model starts equal to the
// base model, trains only its adapters through RoundPipe (frozen parameters
// get neither optimizer copies nor gradients), matches an independent
// computation of the same math, and rejects bad uses without changing it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include <roundpipe/lora.h>
#include <roundpipe/optim/adam.h>
#include <roundpipe/presets.h>
#include <roundpipe/trace.h>

#include "models.h"
#include "preset_reference.h"

namespace roundpipe {
namespace testing {
namespace {

const std::vector<std::string> kAllTargets = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                              "gate_proj", "up_proj", "down_proj"};

int64_t devices(int64_t want) { return std::min(want, get_num_devices()); }

// name -> value copy of every parameter.
std::map<std::string, at::Tensor> snapshot(const torch::nn::Sequential& net) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

// name -> requires_grad of every parameter.
std::map<std::string, bool> trainable_flags(const torch::nn::Sequential& net) {
  std::map<std::string, bool> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().requires_grad();
  return out;
}

bool is_adapter(const std::string& name) {
  return name.size() > 7 && (name.compare(name.size() - 7, 7, ".lora_A") == 0 ||
                             name.compare(name.size() - 7, 7, ".lora_B") == 0);
}

// "<i+1>.<rest>" -> "model.layers.<i>.<rest>" (a block's parameter).
std::string hf_block_name(const std::string& ours) {
  const size_t dot = ours.find('.');
  return "model.layers." + std::to_string(std::stoll(ours.substr(0, dot)) - 1) + ours.substr(dot);
}

TEST(Lora, ConfigValidation) {
  EXPECT_NO_THROW(LoraConfig().validate());
  auto with = [](auto change) {
    LoraConfig c;
    change(c);
    return value_error_of([&] { c.validate(); });
  };
  EXPECT_NE(with([](LoraConfig& c) { c.rank = 0; }).find("rank"), std::string::npos);
  EXPECT_NE(with([](LoraConfig& c) { c.alpha = 0; }).find("alpha"), std::string::npos);
  EXPECT_NE(with([](LoraConfig& c) { c.alpha = -1; }).find("alpha"), std::string::npos);
  EXPECT_NE(with([](LoraConfig& c) { c.target_modules.clear(); }).find("target_modules"),
            std::string::npos);
  EXPECT_NE(with([](LoraConfig& c) {
              c.target_modules = {"q_proj", "qkv"};
            }).find("'qkv'"),
            std::string::npos);
}

// B = 0: the adapted model's logits are bitwise the base model's; the
// adapters have the documented names, shapes, initialization and flags, and
// survive cloning.
TEST(Lora, StartsEqualToTheBaseModel) {
  for (const char* type : {"llama", "qwen3"}) {
    SCOPED_TRACE(type);
    torch::manual_seed(11);
    DecoderConfig c = small_config(type, std::string(type) == "qwen3");
    c.attention_bias = true;
    torch::nn::Sequential net = make_decoder(c);
    at::Tensor ids = torch::randint(c.vocab_size, {2, 7});
    at::Tensor base_logits = run_plain(net, {ids}).toTensor();
    const auto base_names = snapshot(net);

    LoraConfig lc;
    lc.rank = 4;
    lc.alpha = 8;
    lc.target_modules = kAllTargets;
    EXPECT_EQ(apply_lora(net, lc), 7 * c.num_hidden_layers);
    EXPECT_TRUE(torch::equal(run_plain(net, {ids}).toTensor(), base_logits));

    auto adapters = lora_parameters(net);
    ASSERT_EQ(adapters.size(), size_t(2 * 7 * c.num_hidden_layers));
    std::set<std::string> names;
    for (const auto& [name, t] : adapters) {
      names.insert(name);
      EXPECT_TRUE(t.requires_grad()) << name;
      EXPECT_EQ(base_names.count(name), 0u) << name;
      const std::string proj = name.substr(0, name.size() - 7);
      const at::Tensor w = net->named_parameters()[proj + ".weight"];
      if (name.back() == 'A') {
        EXPECT_EQ(t.sizes(), at::IntArrayRef({4, w.size(1)})) << name;
        const double bound = 1.0 / std::sqrt(double(w.size(1)));  // kaiming-uniform, a = sqrt(5)
        EXPECT_LE(t.abs().max().item<double>(), bound) << name;
        EXPECT_GT(t.abs().max().item<double>(), 0.5 * bound) << name;
      } else {
        EXPECT_EQ(t.sizes(), at::IntArrayRef({w.size(0), 4})) << name;
        EXPECT_EQ(t.abs().max().item<double>(), 0.0) << name;
      }
    }
    EXPECT_EQ(names.count("1.self_attn.q_proj.lora_A"), 1u);
    EXPECT_EQ(names.count("2.mlp.down_proj.lora_B"), 1u);
    for (const auto& p : net->named_parameters())
      EXPECT_EQ(p.value().requires_grad(), is_adapter(p.key())) << p.key();

    // Clones (one per device under RoundPipe) keep the adapters and their values.
    auto block = std::dynamic_pointer_cast<DecoderBlockImpl>(net[1]->clone());
    ASSERT_TRUE(block);
    EXPECT_TRUE(block->self_attn->q_proj->has_adapter());
    EXPECT_DOUBLE_EQ(block->mlp->up_proj->lora_scaling, 2.0);
    EXPECT_TRUE(torch::equal(block->self_attn->q_proj->lora_A,
                             net[1]->named_parameters()["self_attn.q_proj.lora_A"]));
  }
}

// Only the adapters train: AdamW through RoundPipe on two devices leaves
// every base parameter bitwise unchanged, changes every adapter, and lowers
// the loss. Frozen parameters have no optimizer copy and no gradient.
TEST(Lora, TrainsOnlyTheAdapters) {
  for (const char* type : {"llama", "qwen3"}) {
    SCOPED_TRACE(type);
    torch::manual_seed(12);
    DecoderConfig c = small_config(type, std::string(type) == "qwen3");
    torch::nn::Sequential net = make_decoder(c);
    LoraConfig lc;
    lc.target_modules = {"q_proj", "v_proj", "up_proj", "down_proj"};
    const int64_t adapted = apply_lora(net, lc);
    EXPECT_EQ(adapted, 4 * c.num_hidden_layers);
    const auto before = snapshot(net);

    RoundPipe model(net, RoundPipeOptions().set_max_devices(devices(2)));
    std::set<std::string> optim_names;
    for (const auto& item : model.optim_named_parameters()) optim_names.insert(item.first);
    std::set<std::string> adapter_names;
    for (const auto& item : lora_parameters(net)) adapter_names.insert(item.first);
    EXPECT_EQ(adapter_names.size(), size_t(2 * adapted));
    EXPECT_EQ(optim_names, adapter_names);  // no optimizer copy of a frozen parameter

    optim::AdamW opt(model.optim_parameters(), optim::AdamWOptions(2e-2));
    at::Tensor ids = torch::randint(c.vocab_size, {4, 12});
    at::Tensor labels = ids.roll(-1, 1);
    std::vector<double> losses;
    for (int step = 0; step < 8; ++step) {
      losses.push_back(model
                           .forward_backward({ids}, make_kwargs({{"labels", labels}}),
                                             c10::IValue(), preset_loss_fn(), false,
                                             RunConfig().num_microbatch(2))
                           .toTensor()
                           .item<double>());
      model.step([&] {
        opt.step();
        opt.zero_grad();
      });
    }
    model.synchronize();
    EXPECT_LT(losses.back(), losses.front() - 0.05) << losses.front() << " -> " << losses.back();
    for (const auto& p : net->named_parameters()) {
      const at::Tensor& now = p.value();
      if (is_adapter(p.key())) {
        EXPECT_FALSE(torch::equal(now, before.at(p.key()))) << p.key() << " did not train";
      } else {
        EXPECT_TRUE(torch::equal(now, before.at(p.key()))) << p.key() << " changed";
        EXPECT_FALSE(now.grad().defined()) << p.key() << " received a gradient";
      }
    }
  }
}

// forward_backward of the adapted model through RoundPipe (2 devices, 3
// microbatches) equals the independent reference of the same math: loss and
// every adapter's gradient.
TEST(Lora, MatchesIndependentImplementation) {
  for (const char* type : {"llama", "qwen3"}) {
    for (bool tied : {false, true}) {
      SCOPED_TRACE(std::string(type) + (tied ? " tied" : " untied"));
      torch::manual_seed(13);
      DecoderConfig c = small_config(type, tied);
      c.attention_bias = tied;
      c.mlp_bias = !tied;
      torch::nn::Sequential net = make_decoder(c);
      LoraConfig lc;
      lc.rank = 3;
      lc.alpha = 5;
      lc.target_modules = kAllTargets;
      apply_lora(net, lc);
      {
        torch::NoGradGuard no_grad;  // B != 0, so that A's gradients are not zero
        for (auto& [name, t] : lora_parameters(net)) t.add_(0.1 * torch::randn_like(t));
      }
      // Reference weights: frozen base copies, leaf adapter copies.
      std::map<std::string, at::Tensor> w = hf_weights(c, net);
      for (auto& [hf, t] : w) t.requires_grad_(false);
      std::map<std::string, std::string> hf_of;
      for (const auto& [name, t] : lora_parameters(net)) {
        hf_of[name] = hf_block_name(name);
        w[hf_of[name]] = t.detach().clone().requires_grad_();
      }
      const double scaling = 5.0 / 3.0;

      const int64_t microbatches = 3;
      at::Tensor ids = torch::randint(c.vocab_size, {5, 6}),
                 labels = torch::randint(c.vocab_size, {5, 6});
      labels[1][2] = -100;
      double ref_loss = 0;
      auto xs = ids.tensor_split(microbatches), ys = labels.tensor_split(microbatches);
      for (int64_t m = 0; m < microbatches; ++m) {
        at::Tensor l = full_loss(reference_logits(c, w, xs[m], scaling), ys[m]);
        l.backward();
        ref_loss += l.item<double>();
      }

      RoundPipe model(net, RoundPipeOptions().set_max_devices(devices(2)));
      const double loss =
          model
              .forward_backward({ids}, make_kwargs({{"labels", labels}}), c10::IValue(),
                                preset_loss_fn(), false, RunConfig().num_microbatch(microbatches))
              .toTensor()
              .item<double>();
      model.synchronize();
      EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss));
      for (const auto& [name, t] : lora_parameters(net)) {
        ASSERT_TRUE(t.grad().defined()) << name;
        expect_close(t.grad(), w.at(hf_of.at(name)).grad(), 1e-5, "grad of " + name);
      }
      for (const auto& p : net->named_parameters()) {
        if (!is_adapter(p.key())) {
          EXPECT_FALSE(p.value().grad().defined()) << p.key();
        }
      }
    }
  }
}

// The gradient downloads of a call (the trace's "grads" events) carry the
// adapters' gradients only: frozen parameters' gradients are neither computed
// nor moved.
TEST(Lora, DownloadsOnlyAdapterGradients) {
  torch::manual_seed(15);
  DecoderConfig c = small_config("qwen3", true);
  torch::nn::Sequential net = make_decoder(c);
  apply_lora(net, LoraConfig());
  int64_t adapter_bytes = 0;
  for (const auto& item : lora_parameters(net)) adapter_bytes += int64_t(item.second.nbytes());
  RoundPipe model(net, RoundPipeOptions().set_max_devices(devices(2)).set_name("lora_trace"));
  const std::string path = ::testing::TempDir() + "roundpipe_lora_trace.json";
  start_trace(path);
  at::Tensor ids = torch::randint(c.vocab_size, {4, 6});
  model.forward_backward({ids}, make_kwargs({{"labels", ids.roll(-1, 1)}}), c10::IValue(),
                         preset_loss_fn(), false, RunConfig().num_microbatch(2));
  model.synchronize();
  stop_trace();
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  std::remove(path.c_str());
  const std::string json = text.str();
  const std::regex grads(
      R"re("name":"grads s[0-9]+"[^}]*"model":"lora_trace"[^}]*"bytes":([0-9]+))re");
  int64_t downloaded = 0, events = 0;
  for (auto it = std::sregex_iterator(json.begin(), json.end(), grads);
       it != std::sregex_iterator(); ++it) {
    downloaded += std::stoll((*it)[1].str());
    ++events;
  }
  EXPECT_GT(events, 0);
  EXPECT_EQ(downloaded, adapter_bytes);
}

TEST(Lora, RejectsBadUsesWithoutChangingTheModel) {
  torch::manual_seed(14);
  DecoderConfig c = small_config("llama", false);
  torch::nn::Sequential net = make_decoder(c);
  const auto flags = trainable_flags(net);

  LoraConfig bad;
  bad.target_modules = {"q_proj", "lm_head"};
  EXPECT_NE(value_error_of([&] { apply_lora(net, bad); }).find("'lm_head'"), std::string::npos);
  bad = LoraConfig();
  bad.rank = 0;
  EXPECT_NE(value_error_of([&] { apply_lora(net, bad); }).find("rank"), std::string::npos);
  EXPECT_EQ(trainable_flags(net), flags);
  EXPECT_TRUE(lora_parameters(net).empty());

  // Not a preset: a plain MLP, and blocks without embedding and head.
  torch::nn::Sequential mlp = make_mlp();
  const auto mlp_flags = trainable_flags(mlp);
  EXPECT_NE(value_error_of([&] { apply_lora(mlp, LoraConfig()); }).find("make_decoder"),
            std::string::npos);
  EXPECT_EQ(trainable_flags(mlp), mlp_flags);
  torch::nn::Sequential blocks;
  blocks->push_back(DecoderBlock(c));
  blocks->push_back(DecoderBlock(c));
  EXPECT_NE(value_error_of([&] { apply_lora(blocks, LoraConfig()); }).find("make_decoder"),
            std::string::npos);
  EXPECT_EQ(lora_parameters(blocks).size(), 0u);
  for (const auto& p : blocks->parameters()) EXPECT_TRUE(p.requires_grad());

  // Twice: the second call changes nothing.
  EXPECT_EQ(apply_lora(net, LoraConfig()), 4 * c.num_hidden_layers);
  const auto adapted_flags = trainable_flags(net);
  const auto values = snapshot(net);
  LoraConfig mlp_targets;
  mlp_targets.target_modules = {"gate_proj"};
  EXPECT_NE(value_error_of([&] { apply_lora(net, mlp_targets); }).find("twice"), std::string::npos);
  EXPECT_EQ(trainable_flags(net), adapted_flags);
  EXPECT_EQ(snapshot(net).size(), values.size());
  EXPECT_EQ(lora_parameters(net).size(), size_t(2 * 4 * c.num_hidden_layers));
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
