// Sharded safetensors checkpoints: shard files plus
// model.safetensors.index.json, in the Hugging Face layout.
#include <c10/util/Exception.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "models/file_io.h"
#include "util/atomic_file.h"
#include "models/safetensors_header.h"
#include "models/safetensors_internal.h"
#include "roundpipe/safetensors.h"

namespace roundpipe {
namespace {

using json = nlohmann::json;

std::string shard_name(size_t index, size_t count) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buf;
}

std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return "";
  return slash == 0 ? "/" : path.substr(0, slash);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A shard name from an index: a relative path that stays in the index's
// directory.
bool is_safe_shard_name(const std::string& name) {
  if (name.empty() || name.front() == '/') return false;
  size_t start = 0;
  while (start <= name.size()) {
    size_t slash = name.find('/', start);
    if (slash == std::string::npos) slash = name.size();
    if (name.compare(start, slash - start, "..") == 0 && slash - start == 2) return false;
    start = slash + 1;
  }
  return name.find('\0') == std::string::npos;
}

bool is_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

std::string save_safetensors_sharded(const std::string& dir, const NamedTensors& tensors,
                                     uint64_t max_shard_bytes,
                                     const std::map<std::string, std::string>& metadata) {
  TORCH_CHECK_VALUE(max_shard_bytes > 0, "save_safetensors_sharded: max_shard_bytes must be > 0");
  TORCH_CHECK_VALUE(!dir.empty(), "save_safetensors_sharded: the directory is empty");
  check_tensors_for_safetensors(tensors, dir);

  // Greedy packing in the writer's order.
  std::vector<NamedTensors> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (size_t i : safetensors_write_order(tensors)) {
    const at::Tensor& t = tensors[i].second;
    const uint64_t nbytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    if (!shards.back().empty() && shard_bytes + nbytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(tensors[i]);
    shard_bytes += nbytes;
    total_bytes += nbytes;
  }

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec, "cannot create directory '", dir, "': ", ec.message());

  std::map<std::string, std::string> shard_metadata = metadata;
  shard_metadata.emplace("format", "pt");
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name = shard_name(s, shards.size());
    save_safetensors(join(dir, name), shards[s], shard_metadata);
    for (const auto& item : shards[s]) weight_map[item.first] = name;
  }
  json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", std::move(weight_map)}};
  // Names were checked to be valid UTF-8 by the shards' headers.
  const std::string text = index.dump(2) + "\n";
  const std::string index_path = join(dir, kSafetensorsIndexName);
  AtomicFileWriter out(index_path);
  out.write(text.data(), text.size());
  out.commit();
  return index_path;
}

NamedTensors load_safetensors_index(const std::string& index_path) {
  FileMapping file(index_path);
  TORCH_CHECK_VALUE(file.size() <= kSafetensorsMaxHeaderBytes, "safetensors index '", index_path,
                    "' has ", file.size(), " bytes, more than the limit of ",
                    kSafetensorsMaxHeaderBytes);
  const char* text = reinterpret_cast<const char*>(file.data());
  json root;
  try {
    // (The parser would take a NUL byte for the end of its input.)
    TORCH_CHECK_VALUE(file.size() == 0 || std::memchr(text, '\0', file.size()) == nullptr,
                      "safetensors index '", index_path,
                      "' is not valid JSON: it holds a NUL byte");
    root = json::parse(text, text + file.size());
  } catch (const json::exception& e) {
    TORCH_CHECK_VALUE(false, "safetensors index '", index_path,
                      "' is not valid JSON: ", safetensors_printable(e.what()));
  }
  TORCH_CHECK_VALUE(
      root.is_object() && root.contains("weight_map") && root["weight_map"].is_object(),
      "safetensors index '", index_path,
      "' must be a JSON object with a \"weight_map\" object (tensor name -> shard "
      "file name)");
  const json& weight_map = root["weight_map"];
  std::map<std::string, std::string> shard_of;
  for (const auto& item : weight_map.items()) {
    TORCH_CHECK_VALUE(item.value().is_string(), "safetensors index '", index_path,
                      "': the shard of tensor '", item.key(), "' must be a file name, got ",
                      safetensors_printable(item.value().dump().substr(0, 200)));
    const std::string shard = item.value().get<std::string>();
    TORCH_CHECK_VALUE(is_safe_shard_name(shard), "safetensors index '", index_path,
                      "': the shard of tensor '", item.key(), "' is ",
                      safetensors_printable(item.value().dump().substr(0, 200)),
                      "; shard names must be relative paths inside the index's directory");
    shard_of.emplace(item.key(), shard);
  }

  const std::string dir = directory_of(index_path);
  std::map<std::string, SafetensorsFile> files;
  NamedTensors out;
  for (const auto& [name, shard] : shard_of) {
    auto it = files.find(shard);
    if (it == files.end()) it = files.emplace(shard, SafetensorsFile(join(dir, shard))).first;
    TORCH_CHECK_VALUE(it->second.contains(name), "safetensors index '", index_path,
                      "' lists tensor '", name, "' in shard '", shard,
                      "', which does not contain it");
    out.emplace_back(name, it->second.tensor(name));
  }
  return out;
}

NamedTensors load_safetensors_checkpoint(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    const std::string index = join(path, kSafetensorsIndexName);
    if (is_file(index)) return load_safetensors_index(index);
    const std::string single = join(path, "model.safetensors");
    if (is_file(single)) return load_safetensors(single);
    TORCH_CHECK_VALUE(false, "directory '", path, "' holds neither ", kSafetensorsIndexName,
                      " nor model.safetensors");
  }
  if (ends_with(path, ".json")) return load_safetensors_index(path);
  return load_safetensors(path);
}

}  // namespace roundpipe
