// Safetensors: round trips of every dtype and shape kind, the file layout
// byte for byte, zero-copy mapped reading, atomic writes, sharded checkpoints.
// (Malformed files: test_safetensors_malformed.cpp.)
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "roundpipe/safetensors.h"
#include "safetensors_testing.h"

namespace roundpipe {
namespace testing {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// Round trips

TEST_F(Safetensors, RoundTripsEveryDtypeAndShapeWithMetadata) {
  const NamedTensors tensors = every_dtype();
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "ünïcode \"q\""}};
  save_safetensors(path("m.safetensors"), tensors, meta);

  SafetensorsFile file(path("m.safetensors"));
  EXPECT_EQ(file.metadata(), meta);
  EXPECT_EQ(file.names().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(file.contains(name)) << name;
    expect_same(file.tensor(name), t, name);
    EXPECT_EQ(file.info(name).dtype, t.scalar_type());
    EXPECT_EQ(file.info(name).shape, t.sizes().vec());
  }
  const auto loaded = as_map(load_safetensors(path("m.safetensors")));
  ASSERT_EQ(loaded.size(), tensors.size());
  for (const auto& [name, t] : tensors) expect_same(loaded.at(name), t, name);
}

TEST_F(Safetensors, WritesNonContiguousAndViewInputsAsTheirValues) {
  const at::Tensor base = at::arange(60, at::kFloat).reshape({6, 10});
  const NamedTensors tensors = {
      {"transposed", base.t()},
      {"strided", base.slice(1, 1, 10, 3)},
      {"offset_view", base[4]},
      {"expanded", at::arange(3, at::kInt).unsqueeze(0).expand({4, 3})},
      {"neg_view", at::_neg_view(base)},  // a lazily negated view
  };
  save_safetensors(path("v.safetensors"), tensors);
  const auto loaded = as_map(load_safetensors(path("v.safetensors")));
  for (const auto& [name, t] : tensors) {
    const at::Tensor want = name == "neg_view" ? at::neg(base) : t.contiguous();
    expect_same(loaded.at(name), want, name);
    EXPECT_TRUE(loaded.at(name).is_contiguous());
  }
}

TEST_F(Safetensors, EmptyFileOfNoTensorsRoundTrips) {
  save_safetensors(path("none.safetensors"), {});
  EXPECT_TRUE(load_safetensors(path("none.safetensors")).empty());
  EXPECT_EQ(read_bytes(path("none.safetensors")), u64_le(8) + "{}      ");
}

// The bytes are those of the format description: reference writer order,
// padded header, little-endian row-major data.
TEST_F(Safetensors, WritesTheDocumentedLayout) {
  const NamedTensors tensors = {
      {"b", at::tensor({1.0f, 2.0f})},
      {"a", at::tensor({int8_t{7}}, at::kChar)},
      {"c", at::tensor({3.0, -1.0}, at::kDouble)},
      {"d", at::tensor({1.5f})},
  };
  save_safetensors(path("l.safetensors"), tensors, {{"k", "v"}});
  const std::string bytes = read_bytes(path("l.safetensors"));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const std::string header = bytes.substr(8, n);
  const std::string json_text = header.substr(0, header.find_last_not_of(' ') + 1);
  EXPECT_LT(header.size() - json_text.size(), 8u);
  EXPECT_EQ(json_text, R"({"__metadata__":{"k":"v"},)"
                       R"("c":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[16,24]},)"
                       R"("d":{"dtype":"F32","shape":[1],"data_offsets":[24,28]},)"
                       R"("a":{"dtype":"I8","shape":[1],"data_offsets":[28,29]}})");
  const double c[] = {3.0, -1.0};
  const std::string data = bytes.substr(8 + n);
  EXPECT_EQ(data, std::string(reinterpret_cast<const char*>(c), 16) + float_bytes({1, 2, 1.5f}) +
                      std::string(1, '\x07'));

  SafetensorsFile file(path("l.safetensors"));
  EXPECT_THAT(file.names(), ElementsAre("c", "b", "d", "a"));
  const SafetensorsTensorInfo& info = file.info("d");
  EXPECT_EQ(info.name, "d");
  EXPECT_EQ(info.dtype, at::kFloat);
  EXPECT_EQ(info.begin, 24u);
  EXPECT_EQ(info.end, 28u);
  EXPECT_EQ(info.file_offset, 8 + n + 24);
  EXPECT_EQ(file.file_size(), bytes.size());
}

// A file written by hand from the format description (another writer's
// choices: no alignment, whitespace, unknown fields, its own order).
TEST_F(Safetensors, ReadsFilesOfOtherWriters) {
  std::string header =
      "  {\"x\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1], \"extra\": 1},\n"
      "   \"__metadata__\": {\"who\": \"hand\"},\n"
      "   \"w\": {\"data_offsets\": [1, 9], \"shape\": [2], \"dtype\": \"F32\"}}   ";
  header.append((4 - header.size() % 4) % 4, '\n');  // so that "w" starts misaligned
  write_bytes(path("h.safetensors"),
              st_file(header, std::string(1, '\x2a') + float_bytes({1, -2})));
  SafetensorsFile file(path("h.safetensors"));
  EXPECT_THAT(file.names(), ElementsAre("x", "w"));
  EXPECT_EQ(file.metadata().at("who"), "hand");
  EXPECT_EQ(file.tensor("x").item<uint8_t>(), 42);
  // "w" starts at an odd address: returned as an aligned copy.
  EXPECT_EQ(file.info("w").file_offset % 4, 1u);
  const at::Tensor w = file.tensor("w");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w.data_ptr()) % 4, 0u);
  EXPECT_TRUE(at::equal(w, at::tensor({1.0f, -2.0f})));
}

TEST_F(Safetensors, UnknownNameIsAValueError) {
  save_safetensors(path("u.safetensors"), {{"a", at::ones({1})}});
  SafetensorsFile file(path("u.safetensors"));
  EXPECT_FALSE(file.contains("b"));
  try {
    file.tensor("b");
    FAIL() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("has no tensor 'b'"));
  }
}

// ---------------------------------------------------------------------------
// Mapped reading

// The address range of the mappings of `file` in this process.
std::vector<std::pair<uintptr_t, uintptr_t>> mappings_of(const std::string& file) {
  std::vector<std::pair<uintptr_t, uintptr_t>> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const std::string canonical = fs::canonical(file).string();
  while (std::getline(maps, line)) {
    if (line.size() < canonical.size() ||
        line.compare(line.size() - canonical.size(), canonical.size(), canonical) != 0) {
      continue;
    }
    std::istringstream s(line);
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    s >> std::hex >> lo >> dash >> hi;
    out.emplace_back(lo, hi);
  }
  return out;
}

TEST_F(Safetensors, TensorsAreZeroCopyViewsOfTheMapping) {
  save_safetensors(path("z.safetensors"), {{"a", at::randn({1000})}, {"b", at::randn({64, 64})}});
  SafetensorsFile file(path("z.safetensors"));
  const at::Tensor a = file.tensor("a"), b = file.tensor("b");
  const auto maps = mappings_of(path("z.safetensors"));
  ASSERT_EQ(maps.size(), 1u);
  for (const at::Tensor* t : {&a, &b}) {
    const auto p = reinterpret_cast<uintptr_t>(t->data_ptr());
    EXPECT_GE(p, maps[0].first);
    EXPECT_LE(p + t->nbytes(), maps[0].second);
  }
  const auto& ia = file.info("a");
  const auto& ib = file.info("b");
  EXPECT_EQ(
      static_cast<char*>(b.data_ptr()) - static_cast<char*>(a.data_ptr()),
      static_cast<std::ptrdiff_t>(ib.file_offset) - static_cast<std::ptrdiff_t>(ia.file_offset));
  EXPECT_EQ(file.tensor("a").data_ptr(), a.data_ptr());  // the same view again
  EXPECT_EQ(maps[0].first + ia.file_offset, reinterpret_cast<uintptr_t>(a.data_ptr()));
}

TEST_F(Safetensors, TensorsOutliveTheFileObjectAndTheFile) {
  const at::Tensor want = at::randn({300});
  save_safetensors(path("o.safetensors"), {{"w", want}});
  at::Tensor w;
  {
    SafetensorsFile file(path("o.safetensors"));
    w = file.tensor("w");
  }
  fs::remove(path("o.safetensors"));
  EXPECT_TRUE(at::equal(w, want));
  NamedTensors all = load_safetensors([&] {
    save_safetensors(path("o2.safetensors"), {{"v", want}});
    return path("o2.safetensors");
  }());
  fs::remove(path("o2.safetensors"));
  EXPECT_TRUE(at::equal(all.at(0).second, want));
  all.clear();
  w.reset();  // the last owner unmaps
}

TEST_F(Safetensors, WritesToLoadedTensorsAreCopyOnWrite) {
  save_safetensors(path("c.safetensors"), {{"w", at::zeros({1024})}});
  const std::string before = read_bytes(path("c.safetensors"));
  {
    at::Tensor w = load_safetensors(path("c.safetensors")).at(0).second;
    w.add_(1);
    EXPECT_TRUE(at::equal(w, at::ones({1024})));
    // Another mapping of the file still sees the file's bytes.
    EXPECT_TRUE(at::equal(load_safetensors(path("c.safetensors")).at(0).second, at::zeros({1024})));
  }
  EXPECT_EQ(read_bytes(path("c.safetensors")), before);
}

TEST_F(Safetensors, ReplacingAMappedFileKeepsTheOldTensors) {
  save_safetensors(path("r.safetensors"), {{"w", at::zeros({16})}});
  const at::Tensor old = load_safetensors(path("r.safetensors")).at(0).second;
  save_safetensors(path("r.safetensors"), {{"w", at::ones({16})}});
  EXPECT_TRUE(at::equal(old, at::zeros({16})));
  EXPECT_TRUE(at::equal(load_safetensors(path("r.safetensors")).at(0).second, at::ones({16})));
}

// ---------------------------------------------------------------------------
// Writing: rejected inputs and atomicity

TEST_F(Safetensors, InvalidInputsAreRejectedBeforeAnythingIsWritten) {
  const std::string target = path("keep.safetensors");
  save_safetensors(target, {{"old", at::ones({3})}});
  const std::string before = read_bytes(target);
  struct Case {
    NamedTensors tensors;
    std::string words;
  };
  const std::vector<Case> cases = {
      {{{"a", at::ones({1})}, {"a", at::ones({2})}}, "the name 'a' is given to two tensors"},
      {{{"__metadata__", at::ones({1})}}, "reserved for the metadata"},
      {{{"u", at::Tensor()}}, "tensor 'u' is undefined"},
      {{{"s", at::ones({2, 2}).to_sparse()}}, "only dense tensors"},
      {{{"m", at::empty({2}, at::TensorOptions().device(at::kMeta))}}, "has no data to write"},
      {{{"z", at::ones({2}, at::kComplexFloat)}}, "cannot store"},
      {{{"q", at::quantize_per_tensor(at::ones({2}), 0.1, 0, at::kQInt8)}}, "quantized"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.words);
    try {
      save_safetensors(target, c.tensors);
      ADD_FAILURE() << "no error";
    } catch (const c10::ValueError& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr(c.words));
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr(target));
    }
    EXPECT_EQ(read_bytes(target), before);
    EXPECT_THAT(listing(dir_), ElementsAre("keep.safetensors"));
  }
  // Names and metadata that are not UTF-8 cannot be written as JSON.
  EXPECT_THROW(save_safetensors(target, {{"\xff", at::ones({1})}}), c10::ValueError);
  EXPECT_THROW(save_safetensors(target, {{"a", at::ones({1})}}, {{"k", "\xc3"}}), c10::ValueError);
  EXPECT_EQ(read_bytes(target), before);
  EXPECT_THAT(listing(dir_), ElementsAre("keep.safetensors"));
}

// A write failing part-way (the file size limit stops it after 4 KiB) leaves
// the previous file and no temporary file.
TEST_F(Safetensors, FailedWriteLeavesThePreviousFileIntact) {
  const std::string target = path("keep.safetensors");
  save_safetensors(target, {{"old", at::ones({3})}});
  const std::string before = read_bytes(target);

  struct rlimit old_limit;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limit = old_limit;
  limit.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  std::string message;
  try {
    save_safetensors(target, {{"big", at::randn({100000})}});
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  ::signal(SIGXFSZ, old_handler);

  EXPECT_THAT(message, HasSubstr("cannot write"));
  EXPECT_THAT(message, HasSubstr("keep.safetensors"));
  EXPECT_EQ(read_bytes(target), before);
  EXPECT_THAT(listing(dir_), ElementsAre("keep.safetensors"));
}

TEST_F(Safetensors, UnwritableTargetsRaiseSystemErrors) {
  write_bytes(path("file"), "x");
  try {
    save_safetensors(path("file") + "/x.safetensors", {{"a", at::ones({1})}});
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("cannot create"));
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("Not a directory"));
  }
  EXPECT_THROW(save_safetensors(path("missing/x.safetensors"), {{"a", at::ones({1})}}), c10::Error);
  EXPECT_THAT(listing(dir_), ElementsAre("file"));
}

// ---------------------------------------------------------------------------
// Sharded checkpoints

TEST_F(Safetensors, ShardedRoundTripInTheHuggingFaceLayout) {
  const NamedTensors tensors = {
      {"c", at::randn({256})},   // 1 KiB
      {"b", at::randn({1024})},  // 4 KiB: larger than a shard, alone
      {"a", at::randn({256})},
      {"d", at::randn({256})},
      {"h", at::randn({512}).to(at::kHalf)},  // element size 2: after the 4-byte ones
  };
  const std::string ckpt = path("ckpt/sub");
  const std::string index = save_safetensors_sharded(ckpt, tensors, 2048, {{"step", "7"}});
  EXPECT_EQ(index, ckpt + "/model.safetensors.index.json");
  EXPECT_THAT(listing(ckpt),
              ElementsAre("model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                          "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors",
                          "model.safetensors.index.json"));
  const auto j = nlohmann::json::parse(read_bytes(index));
  EXPECT_EQ(j.at("metadata").at("total_size").get<uint64_t>(), 4096u + 4 * 1024);
  const nlohmann::json want_map = {{"a", "model-00001-of-00004.safetensors"},
                                   {"b", "model-00002-of-00004.safetensors"},
                                   {"c", "model-00003-of-00004.safetensors"},
                                   {"d", "model-00003-of-00004.safetensors"},
                                   {"h", "model-00004-of-00004.safetensors"}};
  EXPECT_EQ(j.at("weight_map"), want_map);
  SafetensorsFile shard(ckpt + "/model-00003-of-00004.safetensors");
  EXPECT_THAT(shard.names(), ElementsAre("c", "d"));
  EXPECT_EQ(shard.metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}, {"step", "7"}}));

  for (const std::string& p : {index, ckpt}) {
    const NamedTensors loaded =
        p == index ? load_safetensors_index(p) : load_safetensors_checkpoint(p);
    ASSERT_EQ(loaded.size(), tensors.size());
    for (size_t i = 0; i < loaded.size(); ++i) {
      EXPECT_EQ(loaded[i].first, std::string(1, "abcdh"[i]));  // sorted by name
    }
    const auto got = as_map(loaded);
    for (const auto& [name, t] : tensors) expect_same(got.at(name), t, name);
  }
  EXPECT_EQ(load_safetensors_checkpoint(ckpt + "/model.safetensors.index.json").size(), 5u);
}

TEST_F(Safetensors, ShardedWriteOfNothingAndOneShard) {
  save_safetensors_sharded(path("none"), {}, 100);
  EXPECT_TRUE(load_safetensors_checkpoint(path("none")).empty());
  save_safetensors_sharded(path("one"), every_dtype(), uint64_t{1} << 40);
  EXPECT_THAT(listing(path("one")),
              ElementsAre("model-00001-of-00001.safetensors", "model.safetensors.index.json"));
  EXPECT_EQ(load_safetensors_index(path("one/model.safetensors.index.json")).size(),
            every_dtype().size());
  EXPECT_THROW(save_safetensors_sharded(path("zero"), {}, 0), c10::ValueError);
}

TEST_F(Safetensors, CheckpointDirectoryWithOneFile) {
  fs::create_directory(path("single"));
  save_safetensors(path("single/model.safetensors"), {{"w", at::ones({2})}});
  EXPECT_EQ(load_safetensors_checkpoint(path("single")).at(0).first, "w");
  EXPECT_EQ(load_safetensors_checkpoint(path("single/model.safetensors")).size(), 1u);
  fs::create_directory(path("nothing"));
  EXPECT_THROW(load_safetensors_checkpoint(path("nothing")), c10::ValueError);
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
