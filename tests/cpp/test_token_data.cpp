// Token data: token files (uint16/uint32) against bytes written here by hand,
// sequence packing, the seeded per-epoch order, resuming from a position, the
// held-out split, malformed inputs, and the built-in corpus.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "roundpipe/token_data.h"

namespace roundpipe {
namespace testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class TokenData : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("roundpipe_token_data_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes raw bytes, independently of write_token_file.
  std::string write_bytes(const std::string& name, const std::vector<unsigned char>& bytes) {
    const std::string p = path(name);
    std::ofstream out(p, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    return p;
  }

  fs::path dir_;
};

at::Tensor arange_tokens(int64_t n, int64_t mod = 1 << 30) {
  return at::arange(n, at::kLong).remainder(mod);
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

template <typename Fn>
std::string value_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return std::string("not a ValueError: ") + e.what();
  }
  return "no error";
}

// ---------------------------------------------------------------------------
// Files

TEST_F(TokenData, ReadsLittleEndianUInt16AndUInt32) {
  // 1, 258, 65535 as uint16; 1, 65536, 4294967295 as uint32.
  const std::string p16 = write_bytes("a.bin", {0x01, 0x00, 0x02, 0x01, 0xff, 0xff});
  TokenFile f16(p16);
  EXPECT_EQ(f16.dtype(), TokenDtype::kUInt16);
  EXPECT_EQ(f16.size(), 3);
  EXPECT_EQ(to_vector(f16.tokens(0, 3)), (std::vector<int64_t>{1, 258, 65535}));
  EXPECT_EQ(to_vector(f16.tokens(1, 1)), (std::vector<int64_t>{258}));
  EXPECT_EQ(f16.tokens(3, 0).numel(), 0);

  const std::string p32 =
      write_bytes("b.bin", {0x01, 0, 0, 0, 0x00, 0x00, 0x01, 0x00, 0xff, 0xff, 0xff, 0xff});
  TokenFile f32(p32, TokenFileOptions().set_dtype(TokenDtype::kUInt32));
  EXPECT_EQ(f32.size(), 3);
  EXPECT_EQ(f32.tokens(0, 3).scalar_type(), at::kLong);
  EXPECT_EQ(to_vector(f32.tokens(0, 3)), (std::vector<int64_t>{1, 65536, 4294967295LL}));
}

TEST_F(TokenData, RoundTripsBothDtypes) {
  for (TokenDtype dtype : {TokenDtype::kUInt16, TokenDtype::kUInt32}) {
    const int64_t max = dtype == TokenDtype::kUInt16 ? 65535 : 4294967295LL;
    at::Tensor tokens = at::cat(
        {at::arange(1000, at::kLong) * 37 % 60000, at::tensor({int64_t{0}, max}, at::kLong)});
    const std::string p = path(std::string(token_dtype_name(dtype)) + ".bin");
    write_token_file(p, tokens, dtype);
    EXPECT_EQ(fs::file_size(p), static_cast<uintmax_t>(1002 * token_dtype_size(dtype)));
    TokenFile f(p, TokenFileOptions().set_dtype(dtype));
    EXPECT_EQ(f.size(), 1002);
    EXPECT_TRUE(at::equal(f.tokens(0, 1002), tokens));
    EXPECT_TRUE(at::equal(f.tokens(500, 10), tokens.narrow(0, 500, 10)));
  }
  // Any integer dtype is accepted; bytes are little-endian.
  write_token_file(path("c.bin"), at::tensor({258, 3}, at::kInt), TokenDtype::kUInt16);
  std::ifstream in(path("c.bin"), std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(bytes, (std::vector<char>{2, 1, 3, 0}));
}

TEST_F(TokenData, DtypeDefaultsFromVocabSize) {
  write_token_file(path("a.bin"), arange_tokens(8), TokenDtype::kUInt32);
  EXPECT_EQ(TokenFile(path("a.bin")).size(), 16);  // read as uint16 by default
  EXPECT_EQ(TokenFile(path("a.bin"), TokenFileOptions().set_vocab_size(100000)).size(), 8);
  EXPECT_EQ(TokenFile(path("a.bin"), TokenFileOptions().set_vocab_size(65536)).dtype(),
            TokenDtype::kUInt16);
  EXPECT_EQ(parse_token_dtype("uint32"), TokenDtype::kUInt32);
  EXPECT_EQ(parse_token_dtype("u16"), TokenDtype::kUInt16);
  EXPECT_THAT(value_error_of([] { parse_token_dtype("int8"); }),
              HasSubstr("unknown token dtype 'int8'"));
}

TEST_F(TokenData, RejectsMalformedFiles) {
  const std::string odd = write_bytes("odd.bin", {1, 2, 3});
  EXPECT_THAT(
      value_error_of([&] { TokenFile f(odd); }),
      HasSubstr("'" + odd + "': its size, 3 bytes, is not a multiple of 2 (the size of uint16)"));
  const std::string six = write_bytes("six.bin", {1, 2, 3, 4, 5, 6});
  EXPECT_THAT(
      value_error_of([&] { TokenFile f(six, TokenFileOptions().set_dtype(TokenDtype::kUInt32)); }),
      HasSubstr("not a multiple of 4"));
  const std::string empty = write_bytes("empty.bin", {});
  EXPECT_THAT(value_error_of([&] { TokenFile f(empty); }), HasSubstr("'" + empty + "' is empty"));
  // A missing file is a system error, not a ValueError.
  EXPECT_THROW(TokenFile f(path("missing.bin")), c10::Error);
  EXPECT_THAT(value_error_of([&] { TokenFile f(path("missing.bin")); }), HasSubstr("missing.bin"));
}

TEST_F(TokenData, ChecksVocabSizeLazilyNamingPositionAndValue) {
  at::Tensor tokens = arange_tokens(100, 50);
  tokens[73] = 50257;
  write_token_file(path("v.bin"), tokens, TokenDtype::kUInt16);
  TokenFile f(path("v.bin"), TokenFileOptions().set_vocab_size(50257));  // opens: lazy
  EXPECT_EQ(to_vector(f.tokens(0, 10)), to_vector(tokens.narrow(0, 0, 10)));
  const std::string msg = value_error_of([&] { f.tokens(70, 10); });
  EXPECT_THAT(msg, HasSubstr(path("v.bin")));
  EXPECT_THAT(msg, HasSubstr("the token at position 73 is 50257, not below vocab_size 50257"));
  EXPECT_THAT(value_error_of([&] { f.validate(); }), HasSubstr("position 73"));
  EXPECT_NO_THROW(TokenFile(path("v.bin")).validate());  // unchecked without vocab_size

  // A batch containing it fails and leaves the position alone.
  TokenBatcher b(f, TokenBatcherOptions(10).shuffle(false));
  b.next_batch(7);  // windows 0..6: tokens [0, 71)
  EXPECT_THAT(value_error_of([&] { b.next_batch(1); }), HasSubstr("position 73"));
  EXPECT_EQ(b.position(), (DataPosition{0, 0, 7}));

  // Ranges out of bounds.
  EXPECT_THAT(value_error_of([&] { f.tokens(95, 6); }), HasSubstr("not within its 100 tokens"));
  EXPECT_THAT(value_error_of([&] { f.tokens(-1, 1); }), HasSubstr("not within"));
}

TEST_F(TokenData, FromTensorAndWriteRejectOutOfRangeTokens) {
  EXPECT_THAT(value_error_of([] {
                TokenFile::from_tensor(at::tensor({1, -2}, at::kLong));
              }),
              HasSubstr("the token at position 1 is -2"));
  EXPECT_THAT(value_error_of([] {
                TokenFile::from_tensor(at::tensor({1, 9}, at::kLong), "mine",
                                       TokenFileOptions().set_vocab_size(8));
              }),
              HasSubstr("'mine': the token at position 1 is 9, not in [0, 8) (vocab_size)"));
  EXPECT_THAT(value_error_of([] {
                TokenFile::from_tensor(at::ones({2, 2}, at::kLong));
              }),
              HasSubstr("1-D"));
  EXPECT_THAT(value_error_of([] { TokenFile::from_tensor(at::ones({2}, at::kFloat)); }),
              HasSubstr("integer dtype"));
  EXPECT_THAT(value_error_of([] { TokenFile::from_tensor(at::empty({0}, at::kLong)); }),
              HasSubstr("is empty"));
  EXPECT_THAT(
      value_error_of([&] {
        write_token_file(path("w.bin"), at::tensor({1, 65536}, at::kLong), TokenDtype::kUInt16);
      }),
      HasSubstr("the token at position 1 is 65536, which does not fit uint16"));
  EXPECT_FALSE(fs::exists(path("w.bin")));
  // A failed write leaves the previous file.
  write_token_file(path("w.bin"), at::tensor({5}, at::kLong), TokenDtype::kUInt16);
  EXPECT_ANY_THROW(
      write_token_file(path("w.bin"), at::tensor({-1}, at::kLong), TokenDtype::kUInt16));
  EXPECT_EQ(to_vector(TokenFile(path("w.bin")).tokens(0, 1)), (std::vector<int64_t>{5}));
}

// ---------------------------------------------------------------------------
// Packing and order

TEST_F(TokenData, LabelsAreInputsShiftedByOneAndMatchTheFile) {
  at::Tensor tokens = (at::arange(1001, at::kLong) * 7919) % 65521;
  write_token_file(path("t.bin"), tokens, TokenDtype::kUInt16);
  TokenFile f(path("t.bin"));
  const int64_t T = 16;
  TokenBatcher b(f, TokenBatcherOptions(T).seed(3));
  EXPECT_EQ(b.train_windows(), 1000 / T);  // (n - 1) / T
  for (int step = 0; step < 5; ++step) {
    const DataPosition pos = b.position();
    TokenBatch batch = b.next_batch(4);
    ASSERT_EQ(batch.input_ids.sizes(), (std::vector<int64_t>{4, T}));
    ASSERT_EQ(batch.labels.sizes(), (std::vector<int64_t>{4, T}));
    EXPECT_EQ(batch.input_ids.scalar_type(), at::kLong);
    EXPECT_TRUE(batch.input_ids.is_contiguous() && batch.labels.is_contiguous());
    EXPECT_TRUE(at::equal(batch.input_ids.narrow(1, 1, T - 1), batch.labels.narrow(1, 0, T - 1)));
    for (int64_t r = 0; r < 4; ++r) {
      const int64_t w = b.window_at(pos.seed, pos.epoch, pos.index + r);
      const int64_t off = b.train_window_offset(w);
      EXPECT_EQ(off, w * T);
      EXPECT_TRUE(at::equal(batch.input_ids[r], tokens.narrow(0, off, T)));
      EXPECT_TRUE(at::equal(batch.labels[r], tokens.narrow(0, off + 1, T)));
    }
  }
}

TEST_F(TokenData, EveryWindowOnceEachEpochAndEveryTokenALabelOnce) {
  const int64_t T = 5;
  const int64_t n = 10 * T + 1 + 3;  // 10 windows, 3 unused trailing tokens
  TokenBatcher b(TokenFile::from_tensor(at::arange(n, at::kLong)), TokenBatcherOptions(T).seed(11));
  ASSERT_EQ(b.train_windows(), 10);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::multiset<int64_t> labels;
    std::set<int64_t> firsts;
    for (int i = 0; i < 5; ++i) {
      TokenBatch batch = b.next_batch(2);
      for (int64_t v : to_vector(batch.labels)) labels.insert(v);
      for (int64_t r = 0; r < 2; ++r) firsts.insert(batch.input_ids[r][0].item<int64_t>());
    }
    EXPECT_EQ(firsts.size(), 10u);
    std::multiset<int64_t> expected;
    for (int64_t v = 1; v <= 10 * T; ++v) expected.insert(v);
    EXPECT_EQ(labels, expected) << "epoch " << epoch;
    EXPECT_EQ(b.position(), (DataPosition{11, epoch + 1, 0}));
  }
}

TEST_F(TokenData, OrderDependsOnSeedAndEpochOnly) {
  const int64_t n = 1000;
  const auto a = shuffled_order(n, 1, 0);
  EXPECT_EQ(a, shuffled_order(n, 1, 0));
  EXPECT_NE(a, shuffled_order(n, 2, 0));
  EXPECT_NE(a, shuffled_order(n, 1, 1));
  std::vector<int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i);
  std::vector<int64_t> identity(n);
  for (int64_t i = 0; i < n; ++i) identity[i] = i;
  EXPECT_NE(a, identity);
  // Pinned values: the order is part of the format of a saved position, so it
  // must not change between versions or platforms.
  EXPECT_EQ(shuffled_order(8, 0, 0), (std::vector<int64_t>{1, 0, 6, 4, 3, 5, 2, 7}));
  EXPECT_EQ(shuffled_order(1, 5, 3), (std::vector<int64_t>{0}));
  EXPECT_TRUE(shuffled_order(0, 5, 3).empty());

  // Batchers: same seed, same batches; another seed, other batches.
  TokenFile f = TokenFile::from_tensor(arange_tokens(4001));
  TokenBatcher x(f, TokenBatcherOptions(8).seed(7));
  TokenBatcher y(f, TokenBatcherOptions(8).seed(7));
  TokenBatcher z(f, TokenBatcherOptions(8).seed(8));
  for (int i = 0; i < 3; ++i) {
    TokenBatch bx = x.next_batch(4), by = y.next_batch(4), bz = z.next_batch(4);
    EXPECT_TRUE(at::equal(bx.input_ids, by.input_ids));
    EXPECT_TRUE(at::equal(bx.labels, by.labels));
    EXPECT_FALSE(at::equal(bx.input_ids, bz.input_ids));
  }
  // Without shuffling: file order, every epoch.
  TokenBatcher s(f, TokenBatcherOptions(8).shuffle(false));
  EXPECT_TRUE(at::equal(s.next_batch(2).input_ids[1], f.tokens(8, 8)));
}

TEST_F(TokenData, SeekResumesBitwiseIncludingAcrossEpochs) {
  TokenFile f = TokenFile::from_tensor((at::arange(7 * 9 + 1, at::kLong) * 31) % 1000);
  const TokenBatcherOptions opts = TokenBatcherOptions(9).seed(42);
  TokenBatcher ref(f, opts);
  ASSERT_EQ(ref.train_windows(), 7);
  // Batches of 3 over 7 windows: boundaries fall inside batches.
  std::vector<DataPosition> positions;
  std::vector<TokenBatch> batches;
  for (int i = 0; i < 12; ++i) {
    positions.push_back(ref.position());
    batches.push_back(ref.next_batch(3));
  }
  EXPECT_EQ(positions[3], (DataPosition{42, 1, 2}));
  for (size_t start : {size_t{0}, size_t{2}, size_t{3}, size_t{7}}) {
    TokenBatcher resumed(f, opts);
    resumed.seek(positions[start]);
    for (size_t i = start; i < batches.size(); ++i) {
      TokenBatch b = resumed.next_batch(3);
      ASSERT_TRUE(at::equal(b.input_ids, batches[i].input_ids)) << start << " " << i;
      ASSERT_TRUE(at::equal(b.labels, batches[i].labels)) << start << " " << i;
    }
    EXPECT_EQ(resumed.position(), ref.position());
  }
  // A batch of 3 crossing the boundary of epoch 0 holds the end of epoch 0's
  // order and the start of epoch 1's.
  TokenBatcher cross(f, opts);
  cross.seek(DataPosition{42, 0, 5});
  TokenBatch b = cross.next_batch(3);
  EXPECT_TRUE(at::equal(b.input_ids[0], f.tokens(9 * cross.window_at(42, 0, 5), 9)));
  EXPECT_TRUE(at::equal(b.input_ids[1], f.tokens(9 * cross.window_at(42, 0, 6), 9)));
  EXPECT_TRUE(at::equal(b.input_ids[2], f.tokens(9 * cross.window_at(42, 1, 0), 9)));
  EXPECT_EQ(cross.position(), (DataPosition{42, 1, 1}));

  // Invalid positions are rejected and change nothing.
  EXPECT_THAT(value_error_of([&] {
                cross.seek(DataPosition{42, 0, 7});
              }),
              HasSubstr("index in [0, 7)"));
  EXPECT_THAT(value_error_of([&] {
                cross.seek(DataPosition{42, -1, 0});
              }),
              HasSubstr("epoch must be >= 0"));
  EXPECT_EQ(cross.position(), (DataPosition{42, 1, 1}));
}

TEST_F(TokenData, EvalSplitIsDisjointFromTraining) {
  const int64_t T = 4;
  const int64_t n = 20 * T + 1;
  TokenFile f = TokenFile::from_tensor(at::arange(n, at::kLong));
  TokenBatcher b(f, TokenBatcherOptions(T).eval_windows(5).seed(1));
  EXPECT_EQ(b.eval_windows(), 5);
  // Evaluation: the last 5*T + 1 tokens; training: the 59 before them.
  EXPECT_EQ(b.train_windows(), (n - (5 * T + 1) - 1) / T);
  std::set<int64_t> train_tokens, eval_tokens;
  for (int i = 0; i < b.train_windows(); ++i) {
    TokenBatch batch = b.next_batch(1);
    for (int64_t v : to_vector(batch.input_ids)) train_tokens.insert(v);
    for (int64_t v : to_vector(batch.labels)) train_tokens.insert(v);
  }
  std::vector<TokenBatch> eval = b.eval_batches(2);
  ASSERT_EQ(eval.size(), 3u);  // 2 + 2 + 1
  EXPECT_EQ(eval[2].input_ids.size(0), 1);
  for (const TokenBatch& batch : eval) {
    EXPECT_TRUE(at::equal(batch.input_ids.narrow(1, 1, T - 1), batch.labels.narrow(1, 0, T - 1)));
    for (int64_t v : to_vector(batch.input_ids)) eval_tokens.insert(v);
    for (int64_t v : to_vector(batch.labels)) eval_tokens.insert(v);
  }
  EXPECT_EQ(eval_tokens.size(), static_cast<size_t>(5 * T + 1));
  EXPECT_EQ(*eval_tokens.begin(), n - (5 * T + 1));
  for (int64_t v : eval_tokens) EXPECT_EQ(train_tokens.count(v), 0u) << v;
  EXPECT_TRUE(at::equal(eval[0].input_ids[0], f.tokens(b.eval_window_offset(0), T)));
  EXPECT_EQ(b.eval_batches(2, /*max_batches=*/1).size(), 1u);

  TokenBatcher frac(f, TokenBatcherOptions(T).eval_fraction(0.1));
  EXPECT_EQ(frac.eval_windows(), 2);  // floor(0.1 * 20)
  TokenBatcher tiny(f, TokenBatcherOptions(T).eval_fraction(0.001));
  EXPECT_EQ(tiny.eval_windows(), 1);
  TokenBatcher none(f, TokenBatcherOptions(T));
  EXPECT_TRUE(none.eval_batches(4).empty());
}

TEST_F(TokenData, RejectsBadArguments) {
  TokenFile f = TokenFile::from_tensor(at::arange(11, at::kLong), "small");
  EXPECT_THAT(value_error_of([&] { TokenBatcher b(f, TokenBatcherOptions(0)); }),
              HasSubstr("seq_len must be >= 1, got 0"));
  EXPECT_THAT(value_error_of([&] { TokenBatcher b(f, TokenBatcherOptions(11)); }),
              HasSubstr("'small' holds 11 tokens, too few for one sequence of seq_len 11 "
                        "(needs at least 12 tokens)"));
  EXPECT_NO_THROW(TokenBatcher(f, TokenBatcherOptions(10)));
  EXPECT_THAT(value_error_of([&] { TokenBatcher b(f, TokenBatcherOptions(5).eval_windows(3)); }),
              HasSubstr("too few for 3 evaluation windows of seq_len 5 plus one training window "
                        "(needs at least 22)"));
  EXPECT_THAT(value_error_of([&] { TokenBatcher b(f, TokenBatcherOptions(3).eval_windows(3)); }),
              HasSubstr("besides the evaluation windows"));
  EXPECT_THAT(value_error_of([&] { TokenBatcher b(f, TokenBatcherOptions(2).eval_windows(-1)); }),
              HasSubstr("eval_windows must be >= 0"));
  EXPECT_THAT(value_error_of([&] { TokenBatcher b(f, TokenBatcherOptions(2).eval_fraction(1.0)); }),
              HasSubstr("eval_fraction must be in [0, 1)"));
  EXPECT_THAT(value_error_of([&] {
                TokenBatcher b(f, TokenBatcherOptions(2).eval_fraction(0.5).eval_windows(1));
              }),
              HasSubstr("not both"));
  TokenBatcher b(f, TokenBatcherOptions(2));
  EXPECT_THAT(value_error_of([&] { b.next_batch(0); }),
              HasSubstr("batch_size must be >= 1, got 0"));
  EXPECT_THAT(value_error_of([&] { b.eval_batches(0); }), HasSubstr("batch_size must be >= 1"));
  // A batch larger than an epoch wraps around.
  EXPECT_EQ(b.next_batch(12).input_ids.size(0), 12);
  EXPECT_EQ(b.position(), (DataPosition{0, 2, 2}));
}

// ---------------------------------------------------------------------------
// The built-in corpus

TEST_F(TokenData, DefaultCorpusRoundTripsAndIsEnglish) {
  const std::string_view text = default_corpus();
  EXPECT_GT(text.size(), 20000u);
  EXPECT_LT(text.size(), 65536u);
  EXPECT_NE(text.find("Alice"), std::string_view::npos);
  EXPECT_NE(text.find("Down the Rabbit-Hole"), std::string_view::npos);
  at::Tensor tokens = default_token_data();
  EXPECT_EQ(tokens.numel(), static_cast<int64_t>(text.size()));
  EXPECT_EQ(decode_bytes(tokens), std::string(text));
  EXPECT_LT(tokens.max().item<int64_t>(), kByteVocabSize);
  // Non-trivial: many distinct bytes.
  std::set<int64_t> distinct;
  for (int64_t v : to_vector(tokens)) distinct.insert(v);
  EXPECT_GT(distinct.size(), 60u);

  TokenFile f = default_token_file();
  EXPECT_EQ(f.vocab_size(), kByteVocabSize);
  EXPECT_EQ(f.size(), tokens.numel());
  TokenBatcher b(f, TokenBatcherOptions(64).eval_fraction(0.05));
  EXPECT_GT(b.train_windows(), 400);
  TokenBatch batch = b.next_batch(2);
  EXPECT_EQ(decode_bytes(batch.input_ids[0]).size(), 64u);
}

TEST_F(TokenData, ByteTokenizer) {
  at::Tensor t = encode_bytes(std::string_view("caf\xc3\xa9 \x00\xff!", 9));
  EXPECT_EQ(to_vector(t), (std::vector<int64_t>{99, 97, 102, 0xc3, 0xa9, 32, 0, 255, 33}));
  EXPECT_EQ(decode_bytes(t), std::string("caf\xc3\xa9 \x00\xff!", 9));
  EXPECT_EQ(encode_bytes("").numel(), 0);
  EXPECT_EQ(decode_bytes(at::empty({0}, at::kLong)), "");
  EXPECT_THAT(value_error_of([] {
                decode_bytes(at::tensor({65, 256}, at::kLong));
              }),
              HasSubstr("the token at position 1 is 256, not a byte in [0, 256)"));
  EXPECT_EQ(decode_bytes(at::tensor({72, 105}, at::kInt)), "Hi");
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
