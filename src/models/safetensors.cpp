// Safetensors files: the mapped reader (SafetensorsFile) and the atomic,
// streaming writer.
#include "roundpipe/safetensors.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <unordered_map>

#include "models/file_io.h"
#include "util/atomic_file.h"
#include "models/safetensors_header.h"
#include "models/safetensors_internal.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors I/O assumes a little-endian host"
#endif

namespace roundpipe {
namespace {

struct DtypeMapping {
  const char* name;
  at::ScalarType type;
};

constexpr DtypeMapping kDtypeMappings[] = {
    {"F64", at::kDouble},
    {"F32", at::kFloat},
    {"F16", at::kHalf},
    {"BF16", at::kBFloat16},
    {"I64", at::kLong},
    {"I32", at::kInt},
    {"I16", at::kShort},
    {"I8", at::kChar},
    {"U8", at::kByte},
    {"BOOL", at::kBool},
    {"F8_E4M3", c10::ScalarType::Float8_e4m3fn},
    {"F8_E5M2", c10::ScalarType::Float8_e5m2},
    {"U16", c10::ScalarType::UInt16},
    {"U32", c10::ScalarType::UInt32},
    {"U64", c10::ScalarType::UInt64},
};

bool scalar_type_of(const std::string& name, at::ScalarType* out) {
  for (const auto& m : kDtypeMappings) {
    if (name == m.name) {
      *out = m.type;
      return true;
    }
  }
  return false;
}

std::string supported_dtypes() {
  std::string out;
  for (const auto& m : kDtypeMappings) {
    out += std::string(out.empty() ? "" : ", ") + m.name + " (" + c10::toString(m.type) + ")";
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------
// Reading

struct SafetensorsFile::Impl {
  std::string path;
  std::shared_ptr<const FileMapping> mapping;
  std::vector<std::string> names;  // in the order of their bytes
  std::unordered_map<std::string, SafetensorsTensorInfo> infos;
  std::map<std::string, std::string> metadata;
};

SafetensorsFile::SafetensorsFile(const std::string& path) {
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  impl->mapping = std::make_shared<const FileMapping>(path);
  const FileMapping& m = *impl->mapping;
  SafetensorsHeader header = parse_safetensors_header(m.data(), m.size(), path);
  impl->metadata = std::move(header.metadata);
  for (auto& e : header.entries) {
    SafetensorsTensorInfo info;
    TORCH_CHECK_VALUE(scalar_type_of(e.dtype, &info.dtype), "safetensors file '", path,
                      "': tensor '", safetensors_printable(e.name.substr(0, 200)), "' has dtype ",
                      e.dtype, ", which libtorch ", TORCH_VERSION,
                      " does not support (supported: ", supported_dtypes(), ")");
    info.name = e.name;
    info.shape = std::move(e.shape);
    info.begin = e.begin;
    info.end = e.end;
    info.file_offset = header.data_offset + e.begin;
    impl->names.push_back(e.name);
    impl->infos.emplace(e.name, std::move(info));
  }
  impl_ = std::move(impl);
}

const std::string& SafetensorsFile::path() const { return impl_->path; }

const std::vector<std::string>& SafetensorsFile::names() const { return impl_->names; }

bool SafetensorsFile::contains(const std::string& name) const {
  return impl_->infos.count(name) != 0;
}

const SafetensorsTensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = impl_->infos.find(name);
  TORCH_CHECK_VALUE(it != impl_->infos.end(), "safetensors file '", impl_->path,
                    "' has no tensor '", name, "'");
  return it->second;
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsTensorInfo& i = info(name);
  const auto options = at::TensorOptions().dtype(i.dtype).device(at::kCPU);
  const size_t nbytes = static_cast<size_t>(i.end - i.begin);
  if (nbytes == 0) return at::empty(i.shape, options);
  unsigned char* data = impl_->mapping->data() + i.file_offset;
  const size_t element_size = c10::elementSize(i.dtype);
  if (reinterpret_cast<uintptr_t>(data) % element_size != 0) {
    at::Tensor copy = at::empty(i.shape, options);
    std::memcpy(copy.data_ptr(), data, nbytes);
    return copy;
  }
  std::shared_ptr<const FileMapping> keep = impl_->mapping;
  return at::from_blob(
      data, i.shape, [keep](void*) {}, options);
}

const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return impl_->metadata;
}

uint64_t SafetensorsFile::file_size() const { return impl_->mapping->size(); }

NamedTensors load_safetensors(const std::string& path) {
  SafetensorsFile file(path);
  NamedTensors out;
  out.reserve(file.names().size());
  for (const auto& name : file.names()) out.emplace_back(name, file.tensor(name));
  return out;
}

// ---------------------------------------------------------------------------
// Writing

const char* safetensors_dtype_name(at::ScalarType dtype) {
  for (const auto& m : kDtypeMappings) {
    if (m.type == dtype) return m.name;
  }
  return nullptr;
}

void check_tensors_for_safetensors(const NamedTensors& tensors, const std::string& path) {
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    const std::string where = "cannot write safetensors file '" + path + "': tensor '" + name + "'";
    TORCH_CHECK_VALUE(name != "__metadata__", "cannot write safetensors file '", path,
                      "': \"__metadata__\" is reserved for the metadata and cannot name a tensor");
    TORCH_CHECK_VALUE(seen.insert(name).second, "cannot write safetensors file '", path,
                      "': the name '", name, "' is given to two tensors");
    TORCH_CHECK_VALUE(t.defined(), where, " is undefined");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, where, " has layout ", t.layout(),
                      "; only dense tensors can be written (convert it with to_dense())");
    TORCH_CHECK_VALUE(!t.is_quantized(), where,
                      " is quantized; only plain dtypes can be written (dequantize it first)");
    TORCH_CHECK_VALUE(!t.is_meta() && t.has_storage(), where, " on device ", t.device(),
                      " has no data to write");
    TORCH_CHECK_VALUE(safetensors_dtype_name(t.scalar_type()) != nullptr, where, " has dtype ",
                      t.scalar_type(), ", which safetensors (with libtorch ", TORCH_VERSION,
                      ") cannot store; supported: ", supported_dtypes());
  }
}

std::vector<size_t> safetensors_write_order(const NamedTensors& tensors) {
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const size_t sa = tensors[a].second.element_size(), sb = tensors[b].second.element_size();
    return sa != sb ? sa > sb : tensors[a].first < tensors[b].first;
  });
  return order;
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  check_tensors_for_safetensors(tensors, path);
  const std::vector<size_t> order = safetensors_write_order(tensors);
  std::vector<SafetensorsEntry> entries;
  uint64_t offset = 0;
  for (size_t i : order) {
    const at::Tensor& t = tensors[i].second;
    SafetensorsEntry e;
    e.name = tensors[i].first;
    e.dtype = safetensors_dtype_name(t.scalar_type());
    e.element_size = t.element_size();
    e.shape = t.sizes().vec();
    e.begin = offset;
    e.end = offset += static_cast<uint64_t>(t.numel()) * e.element_size;
    entries.push_back(std::move(e));
  }
  const std::string header = serialize_safetensors_header(entries, metadata, path);

  AtomicFileWriter out(path);
  out.write(header.data(), header.size());
  for (size_t k = 0; k < order.size(); ++k) {
    const uint64_t nbytes = entries[k].end - entries[k].begin;
    if (nbytes == 0) continue;
    // One tensor at a time on the CPU, contiguous, with no lazy conjugation
    // or negation left.
    at::Tensor t = tensors[order[k]].second.detach();
    if (!t.device().is_cpu()) t = t.to(at::kCPU);
    t = t.resolve_conj().resolve_neg().contiguous();
    TORCH_INTERNAL_ASSERT(static_cast<uint64_t>(t.numel()) * t.element_size() == nbytes);
    out.write(t.data_ptr(), static_cast<size_t>(nbytes));
  }
  out.commit();
}

}  // namespace roundpipe
