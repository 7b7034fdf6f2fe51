#include "models/safetensors_header.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>
#include <tuple>

namespace roundpipe {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr uint64_t kInt64Max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
// Objects and arrays start at depth 0 (the header), 1 (an entry) and 2 (a
// shape or offsets array); anything deeper is not a safetensors header.
constexpr int kMaxContainerDepth = 2;

struct DtypeName {
  const char* name;
  size_t size;
};
// Every dtype of the format with a whole number of bytes per element.
constexpr DtypeName kDtypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
    {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8},
};

// A name or string from the file, fit for a message: JSON-quoted (control
// characters and invalid UTF-8 escaped) and cut to a readable length.
std::string quoted(const std::string& s) {
  constexpr size_t kMax = 120;
  std::string q = json(s.size() > kMax ? s.substr(0, kMax) : s)
                      .dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > kMax) q.insert(q.size() - 1, "...");
  return q;
}

// A JSON value from the file for a message, cut to a readable length.
std::string short_dump(const json& v) {
  constexpr size_t kMax = 120;
  std::string d = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return d.size() > kMax ? d.substr(0, kMax) + "..." : d;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

std::string known_dtypes() {
  std::string out;
  for (const auto& d : kDtypes) out += std::string(out.empty() ? "" : ", ") + d.name;
  return out;
}

// A non-negative JSON integer (negative zero included) as uint64.
bool as_u64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

// Rejects duplicate keys (in any object) and deep nesting while parsing.
class HeaderParseChecks {
 public:
  explicit HeaderParseChecks(const std::string& path) : path_(path) {}

  bool operator()(int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        TORCH_CHECK_VALUE(depth <= kMaxContainerDepth, "safetensors file '", path_,
                          "': the header nests objects or arrays more than ",
                          kMaxContainerDepth + 1, " deep; it is not a safetensors header");
        if (event == json::parse_event_t::object_start) keys_.emplace_back();
        break;
      case json::parse_event_t::object_end:
        keys_.pop_back();
        break;
      case json::parse_event_t::key:
        TORCH_CHECK_VALUE(keys_.back().insert(parsed.get<std::string>()).second,
                          "safetensors file '", path_, "': the header has the key ",
                          quoted(parsed.get<std::string>()), " twice",
                          depth == 1 ? " (a duplicated tensor name)" : "");
        break;
      default:
        break;
    }
    return true;
  }

 private:
  const std::string& path_;
  std::vector<std::set<std::string>> keys_;
};

std::map<std::string, std::string> parse_metadata(const json& v, const std::string& path) {
  TORCH_CHECK_VALUE(v.is_object(), "safetensors file '", path,
                    "': \"__metadata__\" must be an object of strings, got ", v.type_name());
  std::map<std::string, std::string> out;
  for (const auto& item : v.items()) {
    TORCH_CHECK_VALUE(item.value().is_string(), "safetensors file '", path,
                      "': \"__metadata__\" values must be strings, but ", quoted(item.key()),
                      " is ", item.value().type_name());
    out.emplace(item.key(), item.value().get<std::string>());
  }
  return out;
}

SafetensorsEntry parse_entry(const std::string& name, const json& v, uint64_t data_size,
                             const std::string& path) {
  const std::string where = "safetensors file '" + path + "', tensor " + quoted(name) + ": ";
  TORCH_CHECK_VALUE(v.is_object(), where,
                    "the entry must be an object with \"dtype\", \"shape\" and \"data_offsets\", "
                    "got ",
                    v.type_name());
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    TORCH_CHECK_VALUE(v.contains(field), where, "missing field \"", field, "\"");
  }
  SafetensorsEntry e;
  e.name = name;

  const json& dtype = v.at("dtype");
  TORCH_CHECK_VALUE(dtype.is_string(), where, "\"dtype\" must be a string, got ",
                    dtype.type_name());
  e.dtype = dtype.get<std::string>();
  e.element_size = safetensors_dtype_size(e.dtype);
  TORCH_CHECK_VALUE(e.element_size != 0, where, "unknown dtype ", quoted(e.dtype),
                    " (known: ", known_dtypes(), ")");

  const json& shape = v.at("shape");
  TORCH_CHECK_VALUE(shape.is_array(), where, "\"shape\" must be an array, got ", shape.type_name());
  // numel: the element count; bound: the product of max(dim, 1), which bounds
  // every stride, so that shapes like [0, 2^62, 2^62] are rejected too.
  uint64_t numel = 1, bound = e.element_size;
  for (size_t i = 0; i < shape.size(); ++i) {
    uint64_t d = 0;
    TORCH_CHECK_VALUE(as_u64(shape[i], &d) && d <= kInt64Max, where, "shape[", i,
                      "] must be an integer in [0, 2^63), got ", short_dump(shape[i]));
    e.shape.push_back(static_cast<int64_t>(d));
    const bool overflow =
        __builtin_mul_overflow(bound, std::max<uint64_t>(d, 1), &bound) || bound > kInt64Max;
    TORCH_CHECK_VALUE(!overflow, where, "shape ", short_dump(shape), " of dtype ", e.dtype,
                      " is too large: its size in bytes overflows int64");
    numel *= d;  // cannot overflow: numel * element_size <= bound
  }
  const uint64_t nbytes = numel * e.element_size;

  const json& offsets = v.at("data_offsets");
  TORCH_CHECK_VALUE(offsets.is_array() && offsets.size() == 2 && as_u64(offsets[0], &e.begin) &&
                        as_u64(offsets[1], &e.end),
                    where,
                    "\"data_offsets\" must be [begin, end] (two non-negative integers), got ",
                    short_dump(offsets));
  TORCH_CHECK_VALUE(e.begin <= e.end, where, "data_offsets [", e.begin, ", ", e.end,
                    "]: begin is after end");
  TORCH_CHECK_VALUE(e.end <= data_size, where, "data_offsets [", e.begin, ", ", e.end,
                    "] lie outside the data region, which has ", data_size,
                    " bytes (truncated file?)");
  TORCH_CHECK_VALUE(e.end - e.begin == nbytes, where, "data_offsets [", e.begin, ", ", e.end,
                    "] hold ", e.end - e.begin, " bytes, but shape ", shape_str(e.shape),
                    " of dtype ", e.dtype, " needs ", nbytes, " bytes");
  return e;
}

// The tensors must tile the data region: no overlap, no hole, nothing after.
void check_layout(const std::vector<SafetensorsEntry>& entries, uint64_t data_size,
                  const std::string& path) {
  uint64_t cursor = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const auto& e : entries) {
    TORCH_CHECK_VALUE(e.begin >= cursor, "safetensors file '", path, "': tensors ",
                      quoted(prev->name), " (bytes [", prev->begin, ", ", prev->end, ")) and ",
                      quoted(e.name), " (bytes [", e.begin, ", ", e.end,
                      ")) overlap in the data region");
    TORCH_CHECK_VALUE(e.begin == cursor, "safetensors file '", path, "': bytes [", cursor, ", ",
                      e.begin, ") of the data region belong to no tensor (a hole before ",
                      quoted(e.name), "); tensors must cover the data region without gaps");
    cursor = e.end;
    prev = &e;
  }
  TORCH_CHECK_VALUE(cursor == data_size, "safetensors file '", path, "': ", data_size - cursor,
                    " bytes after the last tensor belong to no tensor (the data region has ",
                    data_size, " bytes, the tensors cover ", cursor, ")");
}

}  // namespace

std::string safetensors_printable(const std::string& s) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

size_t safetensors_dtype_size(const std::string& dtype) {
  for (const auto& d : kDtypes) {
    if (dtype == d.name) return d.size;
  }
  return 0;
}

SafetensorsHeader parse_safetensors_header(const unsigned char* file, uint64_t file_size,
                                           const std::string& path) {
  TORCH_CHECK_VALUE(file_size >= 8, "safetensors file '", path, "' has ", file_size,
                    " bytes, fewer than the 8 of the header length: truncated or not a "
                    "safetensors file");
  SafetensorsHeader h;
  for (int i = 7; i >= 0; --i) h.header_size = (h.header_size << 8) | file[i];
  TORCH_CHECK_VALUE(h.header_size <= kSafetensorsMaxHeaderBytes, "safetensors file '", path,
                    "': the header length ", h.header_size, " exceeds the limit of ",
                    kSafetensorsMaxHeaderBytes,
                    " bytes (corrupt, hostile or not a safetensors file)");
  TORCH_CHECK_VALUE(h.header_size <= file_size - 8, "safetensors file '", path,
                    "': the header length ", h.header_size, " exceeds the ", file_size - 8,
                    " bytes after the length field: truncated or not a safetensors file");
  h.data_offset = 8 + h.header_size;
  const uint64_t data_size = file_size - h.data_offset;
  const char* text = reinterpret_cast<const char*>(file + 8);
  // The JSON parser would stop at a NUL byte as at the end of its input; JSON
  // has no place for one (strings escape control characters).
  const void* nul = std::memchr(text, '\0', h.header_size);
  TORCH_CHECK_VALUE(nul == nullptr, "safetensors file '", path,
                    "': the header is not valid UTF-8 JSON: a NUL byte at offset ",
                    static_cast<const char*>(nul) - text, " (headers are padded with spaces)");

  json root;
  try {
    root = json::parse(text, text + h.header_size, HeaderParseChecks(path));
  } catch (const json::exception& e) {
    TORCH_CHECK_VALUE(false, "safetensors file '", path,
                      "': the header is not valid UTF-8 JSON: ", safetensors_printable(e.what()));
  }
  TORCH_CHECK_VALUE(root.is_object(), "safetensors file '", path,
                    "': the header must be a JSON object, got ", root.type_name());

  for (const auto& item : root.items()) {
    if (item.key() == "__metadata__") {
      h.metadata = parse_metadata(item.value(), path);
    } else {
      h.entries.push_back(parse_entry(item.key(), item.value(), data_size, path));
    }
  }
  std::sort(h.entries.begin(), h.entries.end(), [](const auto& a, const auto& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  check_layout(h.entries, data_size, path);
  return h;
}

std::string serialize_safetensors_header(const std::vector<SafetensorsEntry>& entries,
                                         const std::map<std::string, std::string>& metadata,
                                         const std::string& path) {
  ordered_json root = ordered_json::object();
  if (!metadata.empty()) {
    ordered_json meta = ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    root["__metadata__"] = std::move(meta);
  }
  for (const auto& e : entries) {
    ordered_json entry = ordered_json::object();
    entry["dtype"] = e.dtype;
    entry["shape"] = e.shape;
    entry["data_offsets"] = {e.begin, e.end};
    root[e.name] = std::move(entry);
  }
  std::string text;
  try {
    text = root.dump(-1, ' ', false, ordered_json::error_handler_t::strict);
  } catch (const ordered_json::exception& e) {
    TORCH_CHECK_VALUE(false, "cannot write safetensors file '", path,
                      "': a tensor name or metadata string is not valid UTF-8 (", e.what(), ")");
  }
  // The data region starts at a multiple of 8: 8 + N with N % 8 == 0.
  text.append((8 - text.size() % 8) % 8, ' ');
  TORCH_CHECK_VALUE(text.size() <= kSafetensorsMaxHeaderBytes, "cannot write safetensors file '",
                    path, "': its header would have ", text.size(),
                    " bytes, more than readers accept (", kSafetensorsMaxHeaderBytes,
                    "); shorten the names or the metadata, or shard the tensors");
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i, n >>= 8) out[i] = static_cast<char>(n & 0xff);
  return out + text;
}

}  // namespace roundpipe
