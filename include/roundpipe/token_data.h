// Training data for language models: pre-tokenized token files, packed into
// fixed-length sequences and served in a seeded, resumable shuffled order; and
// a small built-in English corpus with a byte-level tokenizer, so training
// needs nothing from outside.
//
//   roundpipe::TokenFile file("train.bin");                 // uint16, mapped
//   roundpipe::TokenBatcher data(file, roundpipe::TokenBatcherOptions(256).seed(1));
//   roundpipe::TokenBatch b = data.next_batch(8);            // [8, 256] int64 each
//   roundpipe::DataPosition pos = data.position();           // save with a checkpoint
//   ...
//   data.seek(pos);                                          // same batches again
//
// The file format: a flat array of token ids, little-endian, each an unsigned
// 16-bit (uint16) or 32-bit (uint32) integer, with no header: the ".bin"
// files of nanoGPT and llm.c-style preprocessing scripts
// (`np.array(ids, dtype=np.uint16).tofile(path)`). The format does not record
// its dtype; TokenFileOptions says which (see there for the default).
//
// Errors: malformed data or arguments raise c10::ValueError (Python:
// ValueError) naming the file; failing system calls (a missing file, a full
// disk) raise c10::Error (Python: RuntimeError) naming the path and the
// system error.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace roundpipe {

// The element type of a token file.
enum class TokenDtype { kUInt16, kUInt32 };

// "uint16" / "uint32" (also "u16", "u32", "uint16_t", "uint32_t"); throws
// c10::ValueError listing the accepted names otherwise.
TokenDtype parse_token_dtype(std::string_view name);
// "uint16" or "uint32".
const char* token_dtype_name(TokenDtype dtype);
// 2 or 4.
int64_t token_dtype_size(TokenDtype dtype);

// Options of a TokenFile.
struct TokenFileOptions {
  // The element type. Default (unset): uint32 when vocab_size > 65536, else
  // uint16 (the nanoGPT convention, which fits GPT-2's 50257 tokens).
  std::optional<TokenDtype> dtype;
  // When > 0, every token must be < vocab_size (a token beyond the model's
  // embedding would otherwise fail deep inside the model, or silently on
  // some devices). 0: unchecked. See TokenFile for when it is checked.
  int64_t vocab_size = 0;

  TokenFileOptions& set_dtype(TokenDtype d) {
    dtype = d;
    return *this;
  }
  TokenFileOptions& set_vocab_size(int64_t v) {
    vocab_size = v;
    return *this;
  }
};

// A token file, opened read-only and memory-mapped (pages are read on first
// access, so files larger than RAM work), or tokens held in memory
// (from_tensor).
//
// Checks at open (c10::ValueError naming the file): the file is not empty,
// its size is a multiple of the element size, vocab_size >= 0.
// The vocabulary check is lazy: tokens() checks the tokens it returns, and the
// error names the file, the token's position (in tokens, from 0) and its
// value; so a bad token in a multi-gigabyte file costs nothing at open and is
// reported when a batch first contains it. validate() checks the whole file
// up front.
//
// The file must not be truncated or rewritten in place while it is open
// (write_token_file replaces files by rename, which is safe).
// Copies are cheap and share the mapping. Thread-safety: immutable after
// construction; every member function may be called from any thread.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path, const TokenFileOptions& options = {});

  // Tokens held in memory: `tokens` is a 1-D tensor of an integer dtype (any
  // device; copied to the CPU as int64); every value must be in [0, 2^32) and,
  // when options.vocab_size > 0, below it (checked here, fully).
  // options.dtype is recorded only. `name` stands for the path in messages.
  static TokenFile from_tensor(const at::Tensor& tokens, const std::string& name = "<memory>",
                               const TokenFileOptions& options = {});

  // The path (or the name given to from_tensor).
  const std::string& path() const;
  TokenDtype dtype() const;
  int64_t vocab_size() const;
  // The number of tokens.
  int64_t size() const;

  // Tokens [begin, begin + count) as a new 1-D int64 CPU tensor.
  // Throws c10::ValueError when the range is not within [0, size()) or when a
  // token is >= vocab_size (see above).
  at::Tensor tokens(int64_t begin, int64_t count) const;
  // Reads tokens [begin, begin + count) into out[0, count) (checked as
  // tokens() does). For batchers; `out` must hold `count` values.
  void read(int64_t begin, int64_t count, int64_t* out) const;

  // Checks every token against vocab_size (a no-op when it is 0); throws as
  // tokens() does, naming the first bad token.
  void validate() const;

 private:
  struct Impl;
  explicit TokenFile(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

// Writes `tokens` (a 1-D tensor of an integer dtype, any device) to `path` as
// a token file of `dtype`. Throws c10::ValueError, before anything is written,
// when a token does not fit the dtype (negative, or >= 2^16 / 2^32).
// Atomic: a temporary file beside `path`, flushed, renamed over `path`; on any
// failure a previous file at `path` is unchanged.
void write_token_file(const std::string& path, const at::Tensor& tokens, TokenDtype dtype);

// One batch: inputs and the labels to predict, labels[b, t] being the token
// that follows input_ids[b, t] in the data.
struct TokenBatch {
  at::Tensor input_ids;  // [B, T] int64 CPU, contiguous
  at::Tensor labels;     // [B, T] int64 CPU, contiguous
};

// Where a TokenBatcher is in its order: the next training window is the
// `index`-th of the permutation of epoch `epoch` drawn from `seed`.
// 0 <= index < the number of training windows (after the last window of an
// epoch the position moves to index 0 of the next epoch).
struct DataPosition {
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t index = 0;

  bool operator==(const DataPosition& o) const {
    return seed == o.seed && epoch == o.epoch && index == o.index;
  }
  bool operator!=(const DataPosition& o) const { return !(*this == o); }

  // As integers by name ("<prefix>.seed", ".epoch", ".index"), for a
  // checkpoint's CheckpointState::extra_state (roundpipe/checkpoint.h).
  std::map<std::string, int64_t> to_state(const std::string& prefix = "data") const;
  // The position that to_state stored; c10::ValueError naming the key when
  // one is missing.
  static DataPosition from_state(const std::map<std::string, int64_t>& state,
                                 const std::string& prefix = "data");
};

// Options of a TokenBatcher, with chained setters.
class TokenBatcherOptions {
 public:
  // seq_len: T, the number of input tokens per sequence (>= 1).
  explicit TokenBatcherOptions(int64_t seq_len) : seq_len_(seq_len) {}

  // The seed of the shuffled order. Default 0.
  TokenBatcherOptions& seed(uint64_t v) {
    seed_ = v;
    return *this;
  }
  // Whether each epoch visits the training windows in a shuffled order
  // (default) or in file order.
  TokenBatcherOptions& shuffle(bool v) {
    shuffle_ = v;
    return *this;
  }
  // Held-out windows for evaluation: a count, or a fraction of all windows
  // (rounded down, at least 1 when the fraction is > 0). At most one of the
  // two may be non-zero. Default: none.
  TokenBatcherOptions& eval_windows(int64_t v) {
    eval_windows_ = v;
    return *this;
  }
  TokenBatcherOptions& eval_fraction(double v) {
    eval_fraction_ = v;
    return *this;
  }

  int64_t seq_len() const { return seq_len_; }
  uint64_t seed() const { return seed_; }
  bool shuffle() const { return shuffle_; }
  int64_t eval_windows() const { return eval_windows_; }
  double eval_fraction() const { return eval_fraction_; }

 private:
  int64_t seq_len_;
  uint64_t seed_ = 0;
  bool shuffle_ = true;
  int64_t eval_windows_ = 0;
  double eval_fraction_ = 0.0;
};

// Packs a token stream into sequences and serves them in batches.
//
// Packing: the stream (documents already concatenated, with whatever
// separator tokens the tokenizer put between them) is cut into windows of
// T + 1 tokens at a stride of T: window w holds tokens [w*T, w*T + T]; its
// inputs are the first T, its labels the last T. The inputs of different
// windows never overlap and every token but the first is a label exactly once
// per epoch; consecutive windows share one boundary token (the last label of
// one is the first input of the next). Trailing tokens that do not fill a
// window are not used. So a part of n tokens holds (n - 1) / T windows.
//
// Split: with E held-out windows, the evaluation part is the last E*T + 1
// tokens of the stream and the training part the tokens before them; the two
// share no token. Training windows are counted within the training part.
//
// Order: epoch e visits the training windows in the order of a permutation
// drawn from (seed, e) by a Fisher-Yates shuffle on a splitmix64 generator,
// specified here so that it is the same on every platform and library
// version. next_batch takes the next B windows of that order; a batch that
// runs past the end of an epoch continues with the next epoch's order, so
// every batch is full and an epoch boundary may fall inside a batch.
//
// Resuming: position() is the whole state; seek(position()) on a batcher over
// the same tokens with the same options reproduces the following batches
// bitwise.
//
// Thread-compatible: one thread at a time, const calls included (the
// shuffled order of the current epoch is cached inside).
class TokenBatcher {
 public:
  // Throws c10::ValueError when seq_len < 1, when eval_windows < 0 or
  // eval_fraction is not in [0, 1), when both are set, or when the data has
  // fewer than one training window (and E evaluation windows); the message
  // names the file, its size in tokens and what it would need.
  TokenBatcher(TokenFile data, const TokenBatcherOptions& options);

  const TokenFile& data() const { return data_; }
  const TokenBatcherOptions& options() const { return options_; }
  int64_t seq_len() const { return options_.seq_len(); }
  int64_t train_windows() const { return train_windows_; }
  int64_t eval_windows() const { return eval_windows_; }

  // The next `batch_size` training windows (see Order). Throws
  // c10::ValueError when batch_size < 1; lets TokenFile's errors through
  // (then the position is unchanged).
  TokenBatch next_batch(int64_t batch_size);

  DataPosition position() const { return position_; }
  // Moves to `position` (which may carry another seed: the order is then that
  // seed's). Throws c10::ValueError, leaving the position unchanged, when
  // epoch < 0 or index is not in [0, train_windows()).
  void seek(const DataPosition& position);

  // The evaluation windows in order, `batch_size` per batch (the last batch
  // may be smaller); at most `max_batches` batches when it is > 0. Empty
  // when there are no evaluation windows. Throws c10::ValueError when
  // batch_size < 1.
  std::vector<TokenBatch> eval_batches(int64_t batch_size, int64_t max_batches = 0) const;

  // The token offset of training window `window` (an index into the file
  // order, not the shuffled one) and of evaluation window `window`.
  int64_t train_window_offset(int64_t window) const;
  int64_t eval_window_offset(int64_t window) const;
  // The file-order index of the training window at `index` of epoch `epoch`
  // of `seed`'s order.
  int64_t window_at(uint64_t seed, int64_t epoch, int64_t index) const;

 private:
  const std::vector<int64_t>& order(uint64_t seed, int64_t epoch) const;

  TokenFile data_;
  TokenBatcherOptions options_;
  int64_t train_windows_ = 0;
  int64_t eval_windows_ = 0;
  int64_t eval_begin_ = 0;  // token offset of the evaluation part
  DataPosition position_;
  // The permutation of (cached_seed_, cached_epoch_), built on demand.
  mutable std::vector<int64_t> cached_order_;
  mutable uint64_t cached_seed_ = 0;
  mutable int64_t cached_epoch_ = -1;
};

// The permutation of [0, n) that TokenBatcher uses for epoch `epoch` of
// `seed` (exposed for tests and tools).
std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, int64_t epoch);

// ---------------------------------------------------------------------------
// The built-in corpus and its byte-level tokenizer.
//
// The tokenizer maps each byte of the UTF-8 text to one token, its value
// (0..255); there are no special tokens, so the vocabulary is 256.

inline constexpr int64_t kByteVocabSize = 256;

// The bytes of `text` as a 1-D int64 tensor of values in [0, 256).
at::Tensor encode_bytes(std::string_view text);
// The inverse: a 1-D (or 0-D) integer tensor of values in [0, 256) (any
// device) to its bytes. Throws c10::ValueError naming the position and value
// of a token outside [0, 256).
std::string decode_bytes(const at::Tensor& tokens);

// A small English text in the public domain (the opening chapters of Lewis
// Carroll's "Alice's Adventures in Wonderland", 1865), a few tens of
// kilobytes: enough for a model of a few million parameters to visibly learn
// in minutes on a CPU.
std::string_view default_corpus();
// encode_bytes(default_corpus()).
at::Tensor default_token_data();
// default_token_data() as a TokenFile named "<default corpus>" with
// vocab_size kByteVocabSize.
TokenFile default_token_file();

}  // namespace roundpipe
