// Shared by the safetensors tests: a fixture with a temporary directory, and
// helpers that build files by hand from the format description.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "roundpipe/safetensors.h"

namespace roundpipe {
namespace testing {

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "roundpipe_st_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const {
    return (std::filesystem::path(dir_) / name).string();
  }
  // The names of the files in `dir` (no temporary files left behind).
  static std::vector<std::string> listing(const std::string& dir) {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(dir))
      out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

  std::string dir_;
};

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string u64_le(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i, n >>= 8) out[i] = static_cast<char>(n & 0xff);
  return out;
}

// A file built by hand, following the format description: length, JSON, data.
inline std::string st_file(const std::string& header, const std::string& data = "") {
  return u64_le(header.size()) + header + data;
}

inline std::string float_bytes(std::initializer_list<float> values) {
  std::string out;
  for (float v : values) out.append(reinterpret_cast<const char*>(&v), sizeof v);
  return out;
}

inline void expect_same(const at::Tensor& got, const at::Tensor& want, const std::string& name) {
  SCOPED_TRACE(name);
  EXPECT_EQ(got.scalar_type(), want.scalar_type());
  EXPECT_EQ(got.sizes(), want.sizes());
  EXPECT_TRUE(got.device().is_cpu());
  EXPECT_FALSE(got.requires_grad());
  EXPECT_TRUE(at::equal(got, want.to(at::kCPU)));
}

inline std::map<std::string, at::Tensor> as_map(const NamedTensors& named) {
  return std::map<std::string, at::Tensor>(named.begin(), named.end());
}

// Every dtype of libtorch 1.13 that the format has, of several shape kinds.
inline NamedTensors every_dtype() {
  at::manual_seed(0);
  return {
      {"f64", at::randn({3, 4}, at::kDouble)},
      {"f32", at::randn({5}, at::kFloat)},
      {"f16", at::randn({2, 3}).to(at::kHalf)},
      {"bf16", at::randn({7}).to(at::kBFloat16)},
      {"i64", at::randint(-1000000, 1000000, {2, 2}, at::kLong)},
      {"i32", at::randint(-100000, 100000, {3}, at::kInt)},
      {"i16", at::randint(-30000, 30000, {5}, at::kShort)},
      {"i8", at::randint(-128, 127, {9}, at::kChar)},
      {"u8", at::randint(0, 255, {3, 1, 2}, at::kByte)},
      {"bool", at::randint(0, 2, {6}).to(at::kBool)},
      {"scalar", at::scalar_tensor(3.5, at::kFloat)},
      {"empty", at::empty({0, 3}, at::kFloat)},
      {"empty_i8", at::empty({4, 0}, at::kChar)},
      {"model.layers.0.self_attn.q_proj.weight", at::randn({4, 4})},
  };
}

}  // namespace testing
}  // namespace roundpipe
