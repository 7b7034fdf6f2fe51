#include "data.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace roundpipe {
namespace train {
namespace {

TokenFile open_tokens(const std::string& path, const DataOptions& o) {
  if (path.empty()) {
    TORCH_CHECK_VALUE(o.vocab_size == 0 || o.vocab_size >= kByteVocabSize,
                      "the embedded corpus is byte-tokenized (256 token ids) but the model's "
                      "vocabulary has ",
                      o.vocab_size, ": give --data with the model's tokens");
    return default_token_file();
  }
  TokenFileOptions fo;
  fo.set_vocab_size(o.vocab_size);
  if (!o.dtype.empty()) fo.set_dtype(parse_token_dtype(o.dtype));
  return TokenFile(path, fo);
}

// Evaluation windows of a separate file: consecutive windows of T + 1
// tokens at a stride of T, packed as TokenBatcher packs training data.
std::vector<TokenBatch> file_eval_batches(const TokenFile& file, const DataOptions& o) {
  const int64_t t = o.seq_len;
  const int64_t windows = (file.size() - 1) / t;
  TORCH_CHECK_VALUE(windows >= 1, "evaluation data '", file.path(), "' holds ", file.size(),
                    " tokens: it needs at least --seq-len + 1 = ", t + 1);
  std::vector<TokenBatch> out;
  for (int64_t w = 0; w < windows; w += o.eval_batch_size) {
    if (o.max_eval_batches > 0 && static_cast<int64_t>(out.size()) >= o.max_eval_batches) break;
    const int64_t n = std::min(o.eval_batch_size, windows - w);
    at::Tensor rows = at::empty({n, t + 1}, at::kLong);
    for (int64_t i = 0; i < n; ++i) file.read((w + i) * t, t + 1, rows[i].data_ptr<int64_t>());
    out.push_back({rows.narrow(1, 0, t).contiguous(), rows.narrow(1, 1, t).contiguous()});
  }
  return out;
}

}  // namespace

TrainData make_train_data(const DataOptions& o) {
  TrainData d;
  TokenFile file = open_tokens(o.path, o);
  TokenBatcherOptions bo(o.seq_len);
  bo.seed(o.seed);
  if (o.eval_path.empty()) bo.eval_fraction(o.eval_fraction);
  d.train = std::make_unique<TokenBatcher>(file, bo);
  if (o.eval_path.empty()) {
    d.eval = d.train->eval_batches(o.eval_batch_size, o.max_eval_batches);
  } else {
    d.eval = file_eval_batches(open_tokens(o.eval_path, o), o);
  }
  int64_t eval_windows = 0;
  for (const TokenBatch& b : d.eval) eval_windows += b.input_ids.size(0);
  d.description =
      file.path() + ": " + std::to_string(file.size()) + " tokens, " +
      std::to_string(d.train->train_windows()) + " training sequences of " +
      std::to_string(o.seq_len) + " (shuffle seed " + std::to_string(o.seed) + "); eval: " +
      (eval_windows == 0
           ? std::string("none")
           : std::to_string(eval_windows) + " sequences from " +
                 (o.eval_path.empty() ? std::string("the held-out tail") : o.eval_path));
  return d;
}

}  // namespace train
}  // namespace roundpipe
