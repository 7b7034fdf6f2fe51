// Small models shared by the engine tests, and plain-libtorch references.
#pragma once

#include <roundpipe/models.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace roundpipe {
namespace testing {

// Mean squared error between a tensor output and a tensor label.
inline LossFn mse_loss_fn() {
  return [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return torch::mse_loss(out.toTensor(), y.toTensor());
  };
}

// The ValueError message of `f`, or "" when it does not throw.
template <typename F>
std::string value_error_of(F f) {
  try {
    f();
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  }
  return "";
}

inline torch::nn::Sequential make_mlp(int64_t width = 16, int64_t depth = 4, int64_t out = 4) {
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < depth; ++i) {
    seq->push_back(torch::nn::Linear(width, width));
    seq->push_back(torch::nn::Tanh());
  }
  seq->push_back(torch::nn::Linear(width, out));
  return seq;
}

// A deep copy with the same values (the reference model).
inline torch::nn::Sequential copy_of(const torch::nn::Sequential& seq) {
  return std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
}

// ---- A small transformer whose layers pass (hidden, mask, rotary) ----

constexpr int64_t kVocab = 23, kDim = 16, kSeq = 6;

inline c10::IValue pack(at::Tensor h, at::Tensor mask, at::Tensor rot) {
  return c10::ivalue::Tuple::create({std::move(h), std::move(mask), std::move(rot)});
}

// ids [B, T] (long) -> (hidden [B,T,D], additive causal mask [T,T], rotary [2,T,D/2]).
struct EmbedImpl : torch::nn::Cloneable<EmbedImpl>, ValueLayer {
  EmbedImpl() { reset(); }
  void reset() override { weight = register_parameter("weight", torch::randn({kVocab, kDim}) * 0.5); }
  c10::IValue forward(std::vector<c10::IValue> args, Kwargs kwargs) override {
    at::Tensor ids = args.at(0).toTensor();
    const int64_t t = ids.size(1);
    at::Tensor mask = torch::full({t, t}, -1e9).triu(1);
    at::Tensor pos = torch::arange(t, torch::kFloat).unsqueeze(1);
    at::Tensor freq = torch::pow(100.0, -torch::arange(kDim / 2, torch::kFloat) / (kDim / 2));
    at::Tensor angle = pos * freq;
    return pack(torch::embedding(weight, ids), mask, torch::stack({angle.cos(), angle.sin()}));
  }
  at::Tensor weight;
};
TORCH_MODULE(Embed);

inline at::Tensor rotate(const at::Tensor& x, const at::Tensor& rot) {
  auto halves = x.chunk(2, -1);
  at::Tensor c = rot[0], s = rot[1];
  return torch::cat({halves[0] * c - halves[1] * s, halves[0] * s + halves[1] * c}, -1);
}

// Attention + MLP block. `scale` may be shared with another block (tied
// inside a stage); `running` is a buffer updated in forward (like BatchNorm).
// A tied tensor is registered once (reset() consumes it), so that clones,
// which re-run reset(), get fresh tensors of their own.
struct BlockImpl : torch::nn::Cloneable<BlockImpl>, ValueLayer {
  explicit BlockImpl(at::Tensor shared_scale = {}, double dropout = 0.0)
      : shared(std::move(shared_scale)), p(dropout) {
    reset();
  }
  void reset() override {
    qkv = register_module("qkv", torch::nn::Linear(kDim, 3 * kDim));
    proj = register_module("proj", torch::nn::Linear(kDim, kDim));
    fc = register_module("fc", torch::nn::Linear(kDim, 2 * kDim));
    out = register_module("out", torch::nn::Linear(2 * kDim, kDim));
    scale = register_parameter("scale", shared.defined() ? std::exchange(shared, {}) : torch::ones({kDim}));
    running = register_buffer("running", torch::zeros({kDim}));
  }
  c10::IValue forward(std::vector<c10::IValue> args, Kwargs kwargs) override {
    const auto& in = args.at(0).toTupleRef().elements();
    at::Tensor h = in[0].toTensor(), mask = in[1].toTensor(), rot = in[2].toTensor();
    if (is_training()) {
      torch::NoGradGuard no_grad;
      running.mul_(0.9).add_(h.mean(at::IntArrayRef{0, 1}) * 0.1);
    }
    at::Tensor x = h * scale;
    auto parts = qkv(x).chunk(3, -1);
    at::Tensor q = rotate(parts[0], rot), k = rotate(parts[1], rot);
    at::Tensor att = torch::softmax(q.matmul(k.transpose(1, 2)) / std::sqrt(double(kDim)) + mask, -1);
    h = h + torch::dropout(proj(att.matmul(parts[2])), p, is_training());
    h = h + out(torch::gelu(fc(h)));
    return pack(h, mask, rot);
  }
  at::Tensor shared;
  double p;
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
  at::Tensor scale, running;
};
TORCH_MODULE(Block);

// Final projection onto the (tied) embedding matrix: logits [B, T, V].
struct HeadImpl : torch::nn::Cloneable<HeadImpl>, ValueLayer {
  explicit HeadImpl(at::Tensor tied) : tied_weight(std::move(tied)) { reset(); }
  void reset() override {
    weight = register_parameter("weight", tied_weight.defined() ? std::exchange(tied_weight, {})
                                                                : torch::empty({kVocab, kDim}));
  }
  c10::IValue forward(std::vector<c10::IValue> args, Kwargs kwargs) override {
    at::Tensor h = args.at(0).toTupleRef().elements()[0].toTensor();
    return h.matmul(weight.t());
  }
  at::Tensor tied_weight, weight;
};
TORCH_MODULE(Head);

// Embed | Block x4 (blocks 1 and 2 share `scale`) | Head (tied to Embed).
inline torch::nn::Sequential make_transformer(double dropout = 0.0) {
  Embed embed;
  at::Tensor shared = torch::ones({kDim}) + 0.1 * torch::randn({kDim});
  torch::nn::Sequential seq;
  seq->push_back(embed);
  seq->push_back(Block(at::Tensor(), dropout));
  seq->push_back(Block(shared, dropout));
  seq->push_back(Block(shared, dropout));
  seq->push_back(Block(at::Tensor(), dropout));
  seq->push_back(Head(embed->weight));
  return seq;
}

// A structural copy of make_transformer's model with the same values and the
// same ties.
inline torch::nn::Sequential copy_transformer(const torch::nn::Sequential& src, double dropout = 0.0) {
  torch::NoGradGuard no_grad;
  torch::nn::Sequential dst = make_transformer(dropout);
  auto s = src->named_parameters(), d = dst->named_parameters();
  for (const auto& item : s) d[item.key()].copy_(item.value());
  auto sb = src->named_buffers(), db = dst->named_buffers();
  for (const auto& item : sb) db[item.key()].copy_(item.value());
  return dst;
}

// Runs a Sequential of value layers the way RoundPipe calls them.
inline c10::IValue run_plain(torch::nn::Sequential seq, const std::vector<c10::IValue>& args) {
  c10::IValue x;
  bool first = true;
  for (auto& any : *seq) {
    auto* value_layer = dynamic_cast<ValueLayer*>(any.ptr().get());
    if (value_layer != nullptr) {
      x = value_layer->forward(first ? args : std::vector<c10::IValue>{x}, make_kwargs());
    } else {
      x = any.forward(first ? args.at(0).toTensor() : x.toTensor());
    }
    first = false;
  }
  return x;
}

inline at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
}

// Expects every tensor pair equal within `rtol` relative to the reference
// tensor's magnitude: max|a - b| <= rtol * max|b|.
inline void expect_all_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                             double rtol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << " #" << i;
    if (!a[i].defined()) continue;
    const double diff = (a[i] - b[i]).abs().max().item<double>();
    const double scale = b[i].abs().max().item<double>();
    EXPECT_LE(diff, rtol * scale) << what << " #" << i << " max diff " << diff << " scale " << scale;
  }
}

inline std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return out;
}

inline std::vector<at::Tensor> values_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

// Each tensor of `a` bitwise equal to the one at the same place in `b`.
inline void expect_all_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                             const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << what << " " << i;
}

}  // namespace testing
}  // namespace roundpipe
