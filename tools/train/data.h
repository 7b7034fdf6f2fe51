// The data of roundpipe-train: the training batcher over --data (or the
// embedded corpus, byte-tokenized) and the evaluation batches (from
// --eval-data, or the held-out tail of the training data).
#pragma once

#include <roundpipe/token_data.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace roundpipe {
namespace train {

struct DataOptions {
  std::string path;       // empty: the embedded corpus
  std::string dtype;      // "uint16" / "uint32"; empty: TokenFileOptions' default
  std::string eval_path;  // empty: hold out eval_fraction of the training data
  double eval_fraction = 0.05;
  int64_t vocab_size = 0;  // the model's; every token must be below it
  int64_t seq_len = 0;
  uint64_t seed = 0;
  int64_t eval_batch_size = 1;
  int64_t max_eval_batches = 0;  // 0: all evaluation windows
};

struct TrainData {
  std::unique_ptr<TokenBatcher> train;
  std::vector<TokenBatch> eval;  // may be empty (no held-out data)
  std::string description;       // one line for the start-up log
};

// Opens the files and builds the batcher. Throws c10::ValueError /
// c10::Error (naming the file) as TokenFile and TokenBatcher do.
TrainData make_train_data(const DataOptions& options);

}  // namespace train
}  // namespace roundpipe
