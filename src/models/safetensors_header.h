// The safetensors header: its parser (which validates the layout of a whole
// file against hostile input) and its writer. No libtorch tensors here: dtypes
// are the format's names; mapping them to at::ScalarType is safetensors.cpp's
// job. The rules checked are listed in include/roundpipe/safetensors.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace roundpipe {

// The largest header accepted (the reference implementation's limit).
constexpr uint64_t kSafetensorsMaxHeaderBytes = 100000000;

// One tensor entry of a header.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;        // the format's name: "F32", "BF16", ...
  size_t element_size = 0;  // bytes per element of `dtype`
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // [begin, end): its bytes in the data region
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t header_size = 0;               // N: the JSON's length in bytes
  uint64_t data_offset = 0;               // 8 + N: where the data region starts in the file
  std::vector<SafetensorsEntry> entries;  // sorted by (begin, end)
  std::map<std::string, std::string> metadata;
};

// Bytes per element of the dtype named `dtype`; 0 when the format has no such
// dtype.
size_t safetensors_dtype_size(const std::string& dtype);

// Parses and validates the header of the whole file held in
// [file, file + file_size): the length prefix, the JSON, and the layout of
// every tensor in the data region. `path` names the file in messages. Throws
// c10::ValueError for every malformed input; reads nothing outside the span.
SafetensorsHeader parse_safetensors_header(const unsigned char* file, uint64_t file_size,
                                           const std::string& path);

// `s` with every byte outside printable ASCII written as \xNN: for messages
// that quote bytes of a file (Python needs valid UTF-8 messages).
std::string safetensors_printable(const std::string& s);

// The first bytes of a file holding `entries` (whose offsets the caller set,
// in this order): the length prefix and the JSON, "__metadata__" first
// (omitted when empty), padded with spaces to a multiple of 8 bytes. Throws
// c10::ValueError when a name or a metadata string is not valid UTF-8.
std::string serialize_safetensors_header(const std::vector<SafetensorsEntry>& entries,
                                         const std::map<std::string, std::string>& metadata,
                                         const std::string& path);

}  // namespace roundpipe
