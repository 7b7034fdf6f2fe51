// Fuzz target: the safetensors header parser (src/models/safetensors_header.h)
// on arbitrary file bytes. It must return a header or throw c10::Error, never
// read outside the span (ASan) or hit undefined behaviour (UBSan); a header it
// accepts must describe tensors that lie inside the file's data region, and
// serializing it again must give a header that parses to the same entries.
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "models/safetensors_header.h"

using roundpipe::SafetensorsHeader;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // An exact-size copy: ASan then flags any read past the end of the file.
  std::vector<unsigned char> file(data, data + size);
  SafetensorsHeader h;
  try {
    h = roundpipe::parse_safetensors_header(file.data(), file.size(), "fuzz.safetensors");
  } catch (const c10::Error&) {
    return 0;
  }
  for (const auto& e : h.entries) {
    if (e.begin > e.end || h.data_offset + e.end > size) std::abort();
    if (e.element_size != roundpipe::safetensors_dtype_size(e.dtype)) std::abort();
  }
  // Round trip: the writer's header for the same entries parses back to them.
  std::string again;
  try {
    again = roundpipe::serialize_safetensors_header(h.entries, h.metadata, "fuzz.safetensors");
  } catch (const c10::Error&) {
    return 0;  // names that are not valid UTF-8 cannot be written
  }
  const uint64_t data_bytes = size - h.data_offset;
  std::vector<unsigned char> rewritten(again.begin(), again.end());
  rewritten.resize(again.size() + data_bytes);
  std::memcpy(rewritten.data() + again.size(), file.data() + h.data_offset, data_bytes);
  SafetensorsHeader h2 =
      roundpipe::parse_safetensors_header(rewritten.data(), rewritten.size(), "again.safetensors");
  if (h2.entries.size() != h.entries.size() || h2.metadata != h.metadata) std::abort();
  for (size_t i = 0; i < h.entries.size(); ++i) {
    const auto& a = h.entries[i];
    const auto& b = h2.entries[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.begin != b.begin ||
        a.end != b.end) {
      std::abort();
    }
  }
  return 0;
}
