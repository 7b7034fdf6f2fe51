// Token files, sequence packing and the seeded resumable order
// (include/roundpipe/token_data.h).
#include "roundpipe/token_data.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "models/file_io.h"
#include "util/atomic_file.h"

namespace roundpipe {
namespace {

constexpr int64_t kUInt32Limit = int64_t{1} << 32;

// splitmix64 (Steele, Lea, Flood 2014): a fixed, portable generator.
uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Uniform in [0, bound), bound >= 1, by rejection (no modulo bias).
uint64_t uniform_below(uint64_t* state, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  for (;;) {
    const uint64_t r = splitmix64(state);
    if (r >= threshold) return r % bound;
  }
}

// Copies `t` (1-D integer) to a contiguous int64 CPU tensor, checked.
at::Tensor int64_tokens(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), what, ": the tokens are an undefined tensor");
  TORCH_CHECK_VALUE(at::isIntegralType(t.scalar_type(), /*includeBool=*/false), what,
                    ": the tokens must have an integer dtype, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() <= 1, what, ": the tokens must be a 1-D tensor, got shape ", t.sizes());
  return t.reshape({-1}).to(at::kCPU, at::kLong).contiguous();
}

}  // namespace

TokenDtype parse_token_dtype(std::string_view name) {
  if (name == "uint16" || name == "u16" || name == "uint16_t") return TokenDtype::kUInt16;
  if (name == "uint32" || name == "u32" || name == "uint32_t") return TokenDtype::kUInt32;
  TORCH_CHECK_VALUE(false, "unknown token dtype '", std::string(name),
                    "': expected \"uint16\" or \"uint32\"");
}

const char* token_dtype_name(TokenDtype dtype) {
  return dtype == TokenDtype::kUInt16 ? "uint16" : "uint32";
}

int64_t token_dtype_size(TokenDtype dtype) { return dtype == TokenDtype::kUInt16 ? 2 : 4; }

// ---------------------------------------------------------------------------
// DataPosition

std::map<std::string, int64_t> DataPosition::to_state(const std::string& prefix) const {
  return {{prefix + ".seed", static_cast<int64_t>(seed)},
          {prefix + ".epoch", epoch},
          {prefix + ".index", index}};
}

DataPosition DataPosition::from_state(const std::map<std::string, int64_t>& state,
                                      const std::string& prefix) {
  auto get = [&](const char* field) {
    const std::string key = prefix + "." + field;
    const auto it = state.find(key);
    TORCH_CHECK_VALUE(it != state.end(), "DataPosition::from_state: no entry '", key,
                      "' (a state that DataPosition::to_state(\"", prefix, "\") filled has one)");
    return it->second;
  };
  DataPosition pos;
  pos.seed = static_cast<uint64_t>(get("seed"));
  pos.epoch = get("epoch");
  pos.index = get("index");
  return pos;
}

// ---------------------------------------------------------------------------
// TokenFile

struct TokenFile::Impl {
  std::string path;
  TokenDtype dtype = TokenDtype::kUInt16;
  int64_t vocab_size = 0;
  int64_t size = 0;
  std::unique_ptr<FileMapping> mapping;  // a file: its bytes
  at::Tensor memory;                     // from_tensor: int64 CPU contiguous
};

namespace {

TokenDtype resolve_dtype(const TokenFileOptions& options) {
  if (options.dtype) return *options.dtype;
  return options.vocab_size > 65536 ? TokenDtype::kUInt32 : TokenDtype::kUInt16;
}

}  // namespace

TokenFile::TokenFile(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

TokenFile::TokenFile(const std::string& path, const TokenFileOptions& options) {
  TORCH_CHECK_VALUE(options.vocab_size >= 0, "token file '", path,
                    "': vocab_size must be >= 0 (0: unchecked), got ", options.vocab_size);
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  impl->dtype = resolve_dtype(options);
  impl->vocab_size = options.vocab_size;
  impl->mapping = std::make_unique<FileMapping>(path);
  const uint64_t bytes = impl->mapping->size();
  const auto elem = static_cast<uint64_t>(token_dtype_size(impl->dtype));
  TORCH_CHECK_VALUE(bytes > 0, "token file '", path, "' is empty");
  TORCH_CHECK_VALUE(bytes % elem == 0, "token file '", path, "': its size, ", bytes,
                    " bytes, is not a multiple of ", elem, " (the size of ",
                    token_dtype_name(impl->dtype), "); is it a token file, and of this dtype?");
  impl->size = static_cast<int64_t>(bytes / elem);
  impl_ = std::move(impl);
}

TokenFile TokenFile::from_tensor(const at::Tensor& tokens, const std::string& name,
                                 const TokenFileOptions& options) {
  TORCH_CHECK_VALUE(options.vocab_size >= 0, "token data '", name,
                    "': vocab_size must be >= 0 (0: unchecked), got ", options.vocab_size);
  auto impl = std::make_shared<Impl>();
  impl->path = name;
  impl->dtype = resolve_dtype(options);
  impl->vocab_size = options.vocab_size;
  impl->memory = int64_tokens(tokens, ("token data '" + name + "'").c_str());
  impl->size = impl->memory.numel();
  TORCH_CHECK_VALUE(impl->size > 0, "token data '", name, "' is empty");
  const int64_t* p = impl->memory.data_ptr<int64_t>();
  const int64_t limit = options.vocab_size > 0 ? options.vocab_size : kUInt32Limit;
  for (int64_t i = 0; i < impl->size; ++i) {
    TORCH_CHECK_VALUE(p[i] >= 0 &&
                              p[i]<limit, "token data '", name, "': the token at position ", i,
                                   " is ", p[i], ", not in [0, ", limit, ")", options.vocab_size> 0
                          ? " (vocab_size)"
                          : "");
  }
  return TokenFile(std::shared_ptr<const Impl>(std::move(impl)));
}

const std::string& TokenFile::path() const { return impl_->path; }
TokenDtype TokenFile::dtype() const { return impl_->dtype; }
int64_t TokenFile::vocab_size() const { return impl_->vocab_size; }
int64_t TokenFile::size() const { return impl_->size; }

void TokenFile::read(int64_t begin, int64_t count, int64_t* out) const {
  const Impl& im = *impl_;
  TORCH_CHECK_VALUE(begin >= 0 && count >= 0 && begin <= im.size && count <= im.size - begin,
                    "token file '", im.path, "': tokens [", begin, ", ", begin, " + ", count,
                    ") are not within its ", im.size, " tokens");
  if (im.memory.defined()) {
    const int64_t* p = im.memory.data_ptr<int64_t>() + begin;
    std::copy(p, p + count, out);
  } else if (im.dtype == TokenDtype::kUInt16) {
    const unsigned char* p = im.mapping->data() + begin * 2;
    for (int64_t i = 0; i < count; ++i) {
      out[i] = static_cast<int64_t>(p[2 * i]) | (static_cast<int64_t>(p[2 * i + 1]) << 8);
    }
  } else {
    const unsigned char* p = im.mapping->data() + begin * 4;
    for (int64_t i = 0; i < count; ++i) {
      out[i] = static_cast<int64_t>(p[4 * i]) | (static_cast<int64_t>(p[4 * i + 1]) << 8) |
               (static_cast<int64_t>(p[4 * i + 2]) << 16) |
               (static_cast<int64_t>(p[4 * i + 3]) << 24);
    }
  }
  if (im.vocab_size > 0) {
    for (int64_t i = 0; i < count; ++i) {
      TORCH_CHECK_VALUE(out[i] < im.vocab_size, "token file '", im.path,
                        "': the token at position ", begin + i, " is ", out[i],
                        ", not below vocab_size ", im.vocab_size);
    }
  }
}

at::Tensor TokenFile::tokens(int64_t begin, int64_t count) const {
  TORCH_CHECK_VALUE(count >= 0, "token file '", impl_->path, "': count must be >= 0, got ", count);
  at::Tensor out = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  read(begin, count, out.data_ptr<int64_t>());
  return out;
}

void TokenFile::validate() const {
  if (impl_->vocab_size == 0) return;
  constexpr int64_t kChunk = int64_t{1} << 20;
  std::vector<int64_t> buf(static_cast<size_t>(std::min(kChunk, impl_->size)));
  for (int64_t begin = 0; begin < impl_->size; begin += kChunk) {
    read(begin, std::min(kChunk, impl_->size - begin), buf.data());
  }
}

void write_token_file(const std::string& path, const at::Tensor& tokens, TokenDtype dtype) {
  const std::string what = "cannot write token file '" + path + "'";
  const at::Tensor t = int64_tokens(tokens, what.c_str());
  const int64_t n = t.numel();
  const int64_t* p = t.data_ptr<int64_t>();
  const int64_t elem = token_dtype_size(dtype);
  const int64_t limit = int64_t{1} << (8 * elem);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(p[i] >= 0 && p[i] < limit, what, ": the token at position ", i, " is ", p[i],
                      ", which does not fit ", token_dtype_name(dtype), " [0, ", limit, ")");
  }
  AtomicFileWriter writer(path);
  constexpr int64_t kChunk = int64_t{1} << 16;
  std::vector<unsigned char> buf(static_cast<size_t>(kChunk * elem));
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t count = std::min(kChunk, n - begin);
    for (int64_t i = 0; i < count; ++i) {
      const auto v = static_cast<uint64_t>(p[begin + i]);
      for (int64_t b = 0; b < elem; ++b)
        buf[i * elem + b] = static_cast<unsigned char>(v >> (8 * b));
    }
    writer.write(buf.data(), static_cast<size_t>(count * elem));
  }
  writer.commit();
}

// ---------------------------------------------------------------------------
// TokenBatcher

std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, int64_t epoch) {
  TORCH_CHECK_VALUE(n >= 0, "shuffled_order: n must be >= 0, got ", n);
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  // The epoch's stream: the seed through one splitmix64 step, then the epoch
  // mixed in by an odd multiplier, then Fisher-Yates from the top down.
  uint64_t s = seed;
  uint64_t state = splitmix64(&s) ^ (static_cast<uint64_t>(epoch) * 0xD1B54A32D192ED69ULL);
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(uniform_below(&state, static_cast<uint64_t>(i) + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

TokenBatcher::TokenBatcher(TokenFile data, const TokenBatcherOptions& options)
    : data_(std::move(data)), options_(options) {
  const std::string& path = data_.path();
  const int64_t T = options_.seq_len();
  TORCH_CHECK_VALUE(T >= 1, "TokenBatcher: seq_len must be >= 1, got ", T);
  TORCH_CHECK_VALUE(options_.eval_windows() >= 0, "TokenBatcher: eval_windows must be >= 0, got ",
                    options_.eval_windows());
  const double frac = options_.eval_fraction();
  TORCH_CHECK_VALUE(frac >= 0.0 && frac < 1.0,
                    "TokenBatcher: eval_fraction must be in [0, 1), got ", frac);
  TORCH_CHECK_VALUE(options_.eval_windows() == 0 || frac == 0.0,
                    "TokenBatcher: set eval_windows or eval_fraction, not both");
  const int64_t n = data_.size();
  const int64_t all_windows = (n - 1) / T;
  int64_t e = options_.eval_windows();
  if (frac > 0.0) {
    e = std::max<int64_t>(
        1, static_cast<int64_t>(std::floor(frac * static_cast<double>(all_windows))));
  }
  // Evaluation part: the last e*T + 1 tokens (none when e == 0).
  int64_t train_tokens = n;
  if (e > 0) {
    TORCH_CHECK_VALUE(e <= (n - 1) / T, "TokenBatcher: '", path, "' holds ", n,
                      " tokens, too few for ", e, " evaluation windows of seq_len ", T,
                      " plus one training window (needs at least ", (e + 1) * T + 2, ")");
    train_tokens = n - (e * T + 1);
  }
  train_windows_ = train_tokens >= 1 ? (train_tokens - 1) / T : 0;
  TORCH_CHECK_VALUE(train_windows_ >= 1, "TokenBatcher: '", path, "' holds ", n,
                    " tokens, too few for one sequence of seq_len ", T,
                    e > 0 ? " besides the evaluation windows" : "", " (needs at least ",
                    e > 0 ? (e + 1) * T + 2 : T + 1, " tokens)");
  eval_windows_ = e;
  eval_begin_ = train_tokens;
  position_ = DataPosition{options_.seed(), 0, 0};
}

int64_t TokenBatcher::train_window_offset(int64_t window) const {
  TORCH_CHECK_VALUE(window >= 0 && window < train_windows_, "TokenBatcher: training window ",
                    window, " is not in [0, ", train_windows_, ")");
  return window * seq_len();
}

int64_t TokenBatcher::eval_window_offset(int64_t window) const {
  TORCH_CHECK_VALUE(window >= 0 && window < eval_windows_, "TokenBatcher: evaluation window ",
                    window, " is not in [0, ", eval_windows_, ")");
  return eval_begin_ + window * seq_len();
}

const std::vector<int64_t>& TokenBatcher::order(uint64_t seed, int64_t epoch) const {
  if (cached_epoch_ != epoch || cached_seed_ != seed || cached_order_.empty()) {
    cached_order_ = shuffled_order(train_windows_, seed, epoch);
    cached_seed_ = seed;
    cached_epoch_ = epoch;
  }
  return cached_order_;
}

int64_t TokenBatcher::window_at(uint64_t seed, int64_t epoch, int64_t index) const {
  TORCH_CHECK_VALUE(epoch >= 0 && index >= 0 && index < train_windows_,
                    "TokenBatcher: no window at epoch ", epoch, ", index ", index,
                    " (epoch must be >= 0, index in [0, ", train_windows_, "))");
  if (!options_.shuffle()) return index;
  return order(seed, epoch)[static_cast<size_t>(index)];
}

namespace {

// Splits rows of T + 1 tokens into inputs and labels.
TokenBatch split_rows(const at::Tensor& rows) {
  const int64_t T = rows.size(1) - 1;
  return TokenBatch{rows.narrow(1, 0, T).contiguous(), rows.narrow(1, 1, T).contiguous()};
}

}  // namespace

TokenBatch TokenBatcher::next_batch(int64_t batch_size) {
  TORCH_CHECK_VALUE(batch_size >= 1, "TokenBatcher::next_batch: batch_size must be >= 1, got ",
                    batch_size);
  const int64_t T = seq_len();
  at::Tensor rows = at::empty({batch_size, T + 1}, at::TensorOptions().dtype(at::kLong));
  int64_t* out = rows.data_ptr<int64_t>();
  DataPosition pos = position_;
  for (int64_t b = 0; b < batch_size; ++b) {
    const int64_t w = window_at(pos.seed, pos.epoch, pos.index);
    data_.read(w * T, T + 1, out + b * (T + 1));
    if (++pos.index == train_windows_) {
      pos.index = 0;
      ++pos.epoch;
    }
  }
  position_ = pos;  // only after every read succeeded
  return split_rows(rows);
}

void TokenBatcher::seek(const DataPosition& position) {
  TORCH_CHECK_VALUE(position.epoch >= 0 && position.index >= 0 && position.index < train_windows_,
                    "TokenBatcher::seek: position (seed ", position.seed, ", epoch ",
                    position.epoch, ", index ", position.index, ") is not valid for '",
                    data_.path(), "' with seq_len ", seq_len(),
                    ": epoch must be >= 0 and index in [0, ", train_windows_, ")");
  position_ = position;
}

std::vector<TokenBatch> TokenBatcher::eval_batches(int64_t batch_size, int64_t max_batches) const {
  TORCH_CHECK_VALUE(batch_size >= 1, "TokenBatcher::eval_batches: batch_size must be >= 1, got ",
                    batch_size);
  const int64_t T = seq_len();
  std::vector<TokenBatch> out;
  for (int64_t first = 0; first < eval_windows_; first += batch_size) {
    if (max_batches > 0 && static_cast<int64_t>(out.size()) == max_batches) break;
    const int64_t count = std::min(batch_size, eval_windows_ - first);
    at::Tensor rows = at::empty({count, T + 1}, at::TensorOptions().dtype(at::kLong));
    int64_t* p = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i) {
      data_.read(eval_begin_ + (first + i) * T, T + 1, p + i * (T + 1));
    }
    out.push_back(split_rows(rows));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Byte-level tokenizer

at::Tensor encode_bytes(std::string_view text) {
  at::Tensor out =
      at::empty({static_cast<int64_t>(text.size())}, at::TensorOptions().dtype(at::kLong));
  int64_t* p = out.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) p[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string decode_bytes(const at::Tensor& tokens) {
  const at::Tensor t = int64_tokens(tokens, "decode_bytes");
  const int64_t* p = t.data_ptr<int64_t>();
  std::string out(static_cast<size_t>(t.numel()), '\0');
  for (int64_t i = 0; i < t.numel(); ++i) {
    TORCH_CHECK_VALUE(p[i] >= 0 && p[i] < kByteVocabSize, "decode_bytes: the token at position ", i,
                      " is ", p[i], ", not a byte in [0, ", kByteVocabSize, ")");
    out[static_cast<size_t>(i)] = static_cast<char>(static_cast<unsigned char>(p[i]));
  }
  return out;
}

at::Tensor default_token_data() { return encode_bytes(default_corpus()); }

TokenFile default_token_file() {
  return TokenFile::from_tensor(default_token_data(), "<default corpus>",
                                TokenFileOptions().set_vocab_size(kByteVocabSize));
}

}  // namespace roundpipe
