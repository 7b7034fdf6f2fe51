// Safetensors: a battery of malformed, truncated and randomly corrupted files
// and indexes, each rejected with a clear c10::ValueError (system errors with
// c10::Error), never a crash.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "models/safetensors_header.h"
#include "roundpipe/safetensors.h"
#include "safetensors_testing.h"

namespace roundpipe {
namespace testing {
namespace {

using ::testing::HasSubstr;

TEST_F(Safetensors, MalformedIndexesAreRejected) {
  save_safetensors(path("s.safetensors"), {{"w", at::ones({2})}});
  struct Case {
    std::string text;
    std::string words;
  };
  const std::vector<Case> cases = {
      {"{\"weight_map\": ", "is not valid JSON"},
      {std::string("{\"weight_map\": {}}\0{", 20), "holds a NUL byte"},
      {"[]", "with a \"weight_map\" object"},
      {"{\"metadata\": {}}", "with a \"weight_map\" object"},
      {"{\"weight_map\": {\"w\": 3}}", "must be a file name"},
      {"{\"weight_map\": {\"w\": \"../s.safetensors\"}}", "relative paths inside"},
      {"{\"weight_map\": {\"w\": \"/etc/passwd\"}}", "relative paths inside"},
      {"{\"weight_map\": {\"w\": \"\"}}", "relative paths inside"},
      {"{\"weight_map\": {\"v\": \"s.safetensors\"}}", "lists tensor 'v' in shard 's.safetensors'"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    write_bytes(path("i.json"), c.text);
    try {
      load_safetensors_index(path("i.json"));
      ADD_FAILURE() << "no error";
    } catch (const c10::ValueError& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr(c.words));
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("i.json"));
    }
  }
  write_bytes(path("i.json"), "{\"weight_map\": {\"w\": \"missing.safetensors\"}}");
  EXPECT_THROW(load_safetensors_index(path("i.json")), c10::Error);
  write_bytes(path("i.json"),
              "{\"weight_map\": {\"w\": \"s.safetensors\"}, \"metadata\": {\"total_size\": 8}}");
  EXPECT_EQ(load_safetensors_index(path("i.json")).size(), 1u);
}

// ---------------------------------------------------------------------------
// Malformed files

struct Malformed {
  std::string what;
  std::string bytes;
  std::vector<std::string> words;  // each must appear in the message
};

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\": {\"dtype\": \"" + dtype + "\", \"shape\": " + shape +
         ", \"data_offsets\": " + offsets + "}";
}

std::vector<Malformed> malformed_files() {
  const std::string f2 = float_bytes({1, 2});  // 8 bytes of data
  const std::string ok_a = entry("a", "F32", "[2]", "[0, 8]");
  std::string deep;
  for (int i = 0; i < 100000; ++i) deep += '[';
  for (int i = 0; i < 100000; ++i) deep += ']';
  return {
    {"empty file", "", {"has 0 bytes", "fewer than the 8"}},
        {"truncated length", std::string("\x02\0\0\0", 4), {"has 4 bytes", "truncated"}},
        {"header longer than the file",
         u64_le(100) + "{}",
         {"header length 100 exceeds the 2 bytes"}},
        {"huge header length", u64_le(100000001) + "{}", {"exceeds the limit of 100000000"}},
        {"header length 2^64-1", u64_le(UINT64_MAX) + "{}", {"exceeds the limit"}},
        {"zero header length", u64_le(0), {"not valid UTF-8 JSON"}},
        {"invalid JSON", st_file("{\"a\": "), {"not valid UTF-8 JSON", "parse error"}},
        {"trailing garbage", st_file("{} x"), {"not valid UTF-8 JSON"}},
        {"NUL padding",
         st_file(std::string("{}\0\0", 4)),
         {"not valid UTF-8 JSON", "a NUL byte at offset 2"}},
        {"NUL then more JSON", st_file(std::string("{}\0{\"a\": 1}", 11)), {"a NUL byte"}},
        {"invalid UTF-8", st_file("{\"\xff\": 1}"), {"not valid UTF-8 JSON"}},
        {"not an object: array", st_file("[]"), {"must be a JSON object, got array"}},
        {"not an object: number", st_file("3"), {"must be a JSON object, got number"}},
        {"entry not an object", st_file("{\"a\": 3}"), {"tensor \"a\"", "must be an object"}},
        {"missing dtype",
         st_file("{\"a\": {\"shape\": [], \"data_offsets\": [0, 0]}}"),
         {"tensor \"a\"", "missing field \"dtype\""}},
        {"missing shape",
         st_file("{\"a\": {\"dtype\": \"F32\", \"data_offsets\": [0, 0]}}"),
         {"missing field \"shape\""}},
        {"missing data_offsets",
         st_file("{\"a\": {\"dtype\": \"F32\", \"shape\": []}}"),
         {"missing field \"data_offsets\""}},
        {"dtype not a string",
         st_file("{\"a\": {\"dtype\": 4, \"shape\": [], \"data_offsets\": [0, 4]}}"),
         {"\"dtype\" must be a string, got number"}},
        {"unknown dtype",
         st_file("{" + entry("a", "F33", "[2]", "[0, 8]") + "}", f2),
         {"tensor \"a\"", "unknown dtype \"F33\"", "known: BOOL"}},
        {"sub-byte dtype",
         st_file("{" + entry("a", "F4", "[2]", "[0, 1]") + "}", "x"),
         {"unknown dtype \"F4\""}},
        {"shape not an array",
         st_file("{\"a\": {\"dtype\": \"F32\", \"shape\": 2, \"data_offsets\": [0, 8]}}", f2),
         {"\"shape\" must be an array, got number"}},
        {"negative shape",
         st_file("{" + entry("a", "F32", "[-2]", "[0, 8]") + "}", f2),
         {"shape[0] must be an integer in [0, 2^63), got -2"}},
        {"fractional shape",
         st_file("{" + entry("a", "F32", "[2.5]", "[0, 8]") + "}", f2),
         {"shape[0] must be an integer"}},
        {"string shape",
         st_file("{" + entry("a", "F32", "[\"2\"]", "[0, 8]") + "}", f2),
         {"shape[0] must be an integer"}},
        {"shape 2^63",
         st_file("{" + entry("a", "U8", "[9223372036854775808]", "[0, 8]") + "}", f2),
         {"shape[0] must be an integer in [0, 2^63)"}},
        {"shape beyond uint64",
         st_file("{" + entry("a", "U8", "[1, 18446744073709551616]", "[0, 8]") + "}", f2),
         {"shape[1] must be an integer"}},
        {"shape overflowing int64",
         st_file("{" + entry("a", "F32", "[4294967296, 4294967296]", "[0, 8]") + "}", f2),
         {"is too large", "overflows int64"}},
        {"bytes overflowing int64",
         st_file("{" + entry("a", "F64", "[2305843009213693952]", "[0, 8]") + "}", f2),
         {"overflows int64"}},
        {"empty shape with huge strides",
         st_file("{" +
                     entry("a", "F32", "[0, 4611686018427387904, 4611686018427387904]", "[0, 0]") +
                     ", " + entry("b", "F32", "[2]", "[0, 8]") + "}",
                 f2),
         {"overflows int64"}},
        {"offsets not an array",
         st_file("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": 8}}", f2),
         {"\"data_offsets\" must be [begin, end]"}},
        {"one offset",
         st_file("{" + entry("a", "F32", "[2]", "[8]") + "}", f2),
         {"\"data_offsets\" must be [begin, end]", "got [8]"}},
        {"three offsets",
         st_file("{" + entry("a", "F32", "[2]", "[0, 8, 8]") + "}", f2),
         {"\"data_offsets\" must be [begin, end]"}},
        {"negative offset",
         st_file("{" + entry("a", "F32", "[2]", "[-8, 0]") + "}", f2),
         {"\"data_offsets\" must be [begin, end]"}},
        {"begin after end",
         st_file("{" + entry("a", "F32", "[2]", "[8, 0]") + "}", f2),
         {"tensor \"a\"", "begin is after end"}},
        {"end out of range",
         st_file("{" + entry("a", "F32", "[4]", "[0, 16]") + "}", f2),
         {"data_offsets [0, 16] lie outside the data region, which has 8 bytes"}},
        {"huge end",
         st_file("{" + entry("a", "F32", "[2]", "[0, 18446744073709551615]") + "}", f2),
         {"lie outside the data region"}},
        {"wrong byte size",
         st_file("{" + entry("a", "F32", "[2, 2]", "[0, 8]") + "}", f2),
         {"hold 8 bytes, but shape [2, 2] of dtype F32 needs 16 bytes"}},
        {"overlapping tensors",
         st_file("{" + entry("a", "F32", "[2]", "[0, 8]") + ", " +
                     entry("b", "F32", "[1]", "[4, 8]") + "}",
                 f2),
         {"tensors \"a\"", "\"b\"", "overlap"}},
        {"identical ranges",
         st_file("{" + entry("a", "F32", "[2]", "[0, 8]") + ", " +
                     entry("b", "F32", "[2]", "[0, 8]") + "}",
                 f2),
         {"overlap"}},
        {"hole",
         st_file("{" + entry("a", "F32", "[1]", "[4, 8]") + "}", f2),
         {"bytes [0, 4) of the data region belong to no tensor", "hole"}},
        {"trailing bytes",
         st_file("{" + entry("a", "F32", "[1]", "[0, 4]") + "}", f2),
         {"4 bytes after the last tensor"}},
        {"duplicate tensor name",
         st_file("{" + ok_a + ", " + ok_a + "}", f2),
         {"the key \"a\" twice", "duplicated tensor name"}},
        {"duplicate field",
         st_file(
             "{\"a\": {\"dtype\": \"F32\", \"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": "
             "[0, 8]}}",
             f2),
         {"the key \"dtype\" twice"}},
        {"nesting",
         st_file("{\"a\": {\"x\": [[1]]}}"),
         {"nests objects or arrays more than 3 deep"}},
        {"deep nesting", st_file(deep), {"nests"}},
        {"metadata not an object",
         st_file("{\"__metadata__\": []}"),
         {"\"__metadata__\" must be an object of strings, got array"}},
        {"metadata value not a string",
         st_file("{\"__metadata__\": {\"k\": 1}}"),
         {"values must be strings", "\"k\" is number"}},
        {"long hostile name",
         st_file("{\"" + std::string(10000, 'n') + "\": 1}"),
         {"tensor \"nnnn", "...\": the entry must be an object"}},
  };
}

TEST_F(Safetensors, MalformedFilesAreRejectedWithClearErrors) {
  for (const auto& m : malformed_files()) {
    SCOPED_TRACE(m.what);
    write_bytes(path("bad.safetensors"), m.bytes);
    try {
      SafetensorsFile file(path("bad.safetensors"));
      ADD_FAILURE() << "accepted";
    } catch (const c10::ValueError& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_THAT(msg, HasSubstr("bad.safetensors"));
      for (const auto& w : m.words) EXPECT_THAT(msg, HasSubstr(w));
      EXPECT_LT(msg.size(), 2000u);  // hostile names are cut short
    }
    EXPECT_THROW(load_safetensors(path("bad.safetensors")), c10::ValueError);
  }
}

TEST_F(Safetensors, NotAFileIsASystemError) {
  try {
    SafetensorsFile file(path("missing.safetensors"));
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("cannot open"));
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("No such file"));
  }
  try {
    SafetensorsFile file(dir_);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("not a regular file"));
  }
}

// Every truncation of a valid file is rejected; random byte corruption is
// either rejected with a ValueError or yields tensors that can be read. (The
// parser runs on copies in memory; files are written for a sample of the
// truncations and for every corrupted header that is accepted.)
TEST_F(Safetensors, TruncatedAndCorruptedFilesNeverCrash) {
  save_safetensors(path("good.safetensors"), every_dtype(), {{"format", "pt"}});
  const std::string good = read_bytes(path("good.safetensors"));
  uint64_t header_size = 0;
  std::memcpy(&header_size, good.data(), 8);
  auto parse = [](const std::string& bytes) {
    const std::vector<unsigned char> copy(bytes.begin(), bytes.end());  // exact-size buffer
    return parse_safetensors_header(copy.data(), copy.size(), "corrupt");
  };
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_THROW(parse(good.substr(0, n)), c10::ValueError) << "length " << n;
    if (n < 10 || n % 16 == 0 || n + 1 == good.size() || n == 8 + header_size) {
      write_bytes(path("t.safetensors"), good.substr(0, n));
      EXPECT_THROW(SafetensorsFile(path("t.safetensors")), c10::ValueError) << "length " << n;
    }
  }
  std::mt19937 rng(1234);
  int accepted = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bad = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) {
      // Mostly the header (where parsing happens), sometimes the length.
      const size_t at = rng() % 8 == 0 ? rng() % 8 : 8 + rng() % header_size;
      bad[at] = static_cast<char>(rng() % 256);
    }
    try {
      parse(bad);
    } catch (const c10::ValueError&) {
      continue;
    }
    ++accepted;
    write_bytes(path("f.safetensors"), bad);
    for (const auto& [name, t] : load_safetensors(path("f.safetensors"))) {
      (void)t.to(at::kDouble).sum().item<double>();
    }
  }
  EXPECT_GT(accepted, 0);  // names and values that stay valid
  EXPECT_LT(accepted, 3000);
}

// The parser alone, on spans that are not files.
TEST(SafetensorsHeader, ParsesSpansWithoutReadingPastThem) {
  const std::string bytes =
      st_file("{" + entry("a", "F32", "[2]", "[0, 8]") + "}", float_bytes({1, 2}));
  const SafetensorsHeader h = parse_safetensors_header(
      reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), "span");
  ASSERT_EQ(h.entries.size(), 1u);
  EXPECT_EQ(h.entries[0].dtype, "F32");
  EXPECT_EQ(h.entries[0].element_size, 4u);
  EXPECT_EQ(h.data_offset, bytes.size() - 8);
  for (size_t n = 0; n < bytes.size(); ++n) {
    const std::vector<unsigned char> copy(bytes.begin(),
                                          bytes.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW(parse_safetensors_header(copy.data(), n, "span"), c10::ValueError);
  }
  EXPECT_EQ(safetensors_dtype_size("BF16"), 2u);
  EXPECT_EQ(safetensors_dtype_size("bf16"), 0u);
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
