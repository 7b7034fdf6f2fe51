// Cross-entropy over the LM head in chunks of rows, recomputing each chunk's
// logits in backward instead of saving them.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>

#include "roundpipe/presets.h"

namespace roundpipe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Logits of rows [begin, end) in fp32: [end - begin, V].
at::Tensor chunk_logits(const at::Tensor& hidden, const at::Tensor& weight, int64_t begin,
                        int64_t end) {
  return at::matmul(hidden.slice(0, begin, end), weight.t()).to(at::kFloat);
}

struct ChunkedCrossEntropy : public torch::autograd::Function<ChunkedCrossEntropy> {
  // hidden [N, D], weight [V, D], labels [N] -> 0-dim fp32 loss.
  static at::Tensor forward(AutogradContext* ctx, at::Tensor hidden, at::Tensor weight,
                            at::Tensor labels, int64_t chunk, int64_t ignore_index,
                            bool sum_reduction) {
    const int64_t n = hidden.size(0);
    at::Tensor valid = labels.ne(ignore_index);                           // [N] bool
    at::Tensor safe_labels = labels.masked_fill(valid.logical_not(), 0);  // [N], in [0, V)
    at::Tensor lse = at::empty({n}, hidden.options().dtype(at::kFloat));  // [N] per-row log-sum-exp
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
    for (int64_t begin = 0; begin < n; begin += chunk) {
      const int64_t end = std::min(n, begin + chunk);
      at::Tensor logits = chunk_logits(hidden, weight, begin, end);  // [C, V], freed each iteration
      at::Tensor row_lse = at::logsumexp(logits, -1);
      lse.slice(0, begin, end).copy_(row_lse);
      at::Tensor picked =
          logits.gather(1, safe_labels.slice(0, begin, end).unsqueeze(1)).squeeze(1);
      total += ((row_lse - picked) * valid.slice(0, begin, end)).sum();
    }
    const int64_t count = valid.sum().item<int64_t>();
    const double scale = sum_reduction ? 1.0 : (count > 0 ? 1.0 / double(count) : 0.0);
    ctx->save_for_backward({hidden, weight, safe_labels, valid, lse});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["scale"] = scale;
    return total * scale;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &weight = saved[1], &labels = saved[2], &valid = saved[3],
                     &lse = saved[4];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    // d loss / d logits = scale * g * (softmax - onehot) on counted rows.
    at::Tensor g = grad_outputs[0].to(at::kFloat) * scale;  // 0-dim
    const int64_t n = hidden.size(0);
    at::Tensor grad_hidden = at::empty_like(hidden);
    at::Tensor grad_weight =
        at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));  // fp32 accumulator
    for (int64_t begin = 0; begin < n; begin += chunk) {
      const int64_t end = std::min(n, begin + chunk);
      at::Tensor d =
          (chunk_logits(hidden, weight, begin, end) - lse.slice(0, begin, end).unsqueeze(1)).exp_();
      d.scatter_add_(1, labels.slice(0, begin, end).unsqueeze(1),
                     at::full({end - begin, 1}, -1.0, d.options()));
      d.mul_(valid.slice(0, begin, end).unsqueeze(1).to(at::kFloat) * g);  // [C, V]
      at::Tensor d_in = d.to(hidden.scalar_type());
      grad_hidden.slice(0, begin, end).copy_(at::matmul(d_in, weight));
      grad_weight.add_(at::matmul(d_in.t(), hidden.slice(0, begin, end)).to(at::kFloat));
    }
    return {grad_hidden,  grad_weight.to(weight.scalar_type()),
            at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                 const at::Tensor& labels, int64_t chunk_size, int64_t ignore_index,
                                 bool sum_reduction) {
  TORCH_CHECK_VALUE(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
                    "chunked_cross_entropy: expected hidden [N, D] and weight [V, D], got ",
                    hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK_VALUE(labels.dim() == 1 && labels.size(0) == hidden.size(0),
                    "chunked_cross_entropy: expected labels [", hidden.size(0), "], got ",
                    labels.sizes());
  TORCH_CHECK_TYPE(labels.scalar_type() == at::kLong,
                   "chunked_cross_entropy: labels must be int64, got ", labels.scalar_type());
  TORCH_CHECK_TYPE(hidden.scalar_type() == weight.scalar_type(),
                   "chunked_cross_entropy: hidden and weight dtypes differ (", hidden.scalar_type(),
                   " vs ", weight.scalar_type(), ")");
  TORCH_CHECK_VALUE(chunk_size >= 1, "chunked_cross_entropy: chunk_size must be positive, got ",
                    chunk_size);
  at::Tensor bad =
      labels.ne(ignore_index).logical_and(labels.lt(0).logical_or(labels.ge(weight.size(0))));
  TORCH_CHECK_VALUE(!bad.any().item<bool>(), "chunked_cross_entropy: a label lies outside [0, ",
                    weight.size(0), ") and is not ignore_index (", ignore_index, ")");
  return ChunkedCrossEntropy::apply(hidden, weight, labels, chunk_size, ignore_index,
                                    sum_reduction);
}

}  // namespace roundpipe
