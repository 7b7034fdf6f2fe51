// Safetensors: the weight format of the Hugging Face ecosystem, read through a
// memory mapping (so a model larger than RAM can be opened and paged in on
// demand) and written atomically.
//
//   roundpipe::SafetensorsFile file("model.safetensors");  // maps it, checks the header
//   at::Tensor w = file.tensor("model.embed_tokens.weight");   // zero-copy view
//   roundpipe::save_safetensors("out.safetensors", {{"w", w}}, {{"format", "pt"}});
//
// The format: an 8-byte little-endian unsigned header length N; N bytes of
// UTF-8 JSON, an object mapping each tensor name to
// {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]} plus an
// optional "__metadata__" object of string values; then the data region, in
// which the bytes [begin, end) of each tensor hold its elements row-major,
// little-endian, contiguous. Names are free-form strings (Hugging Face
// names such as "model.layers.0.self_attn.q_proj.weight").
//
// Dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL (at::kDouble ... at::kBool);
// with libtorch >= 2.1 also F8_E4M3 (at::Float8_e4m3fn) and F8_E5M2, with
// libtorch >= 2.3 also U16 U32 U64. A file holding a dtype this libtorch
// lacks is rejected when opened, naming the tensor and the dtype.
//
// What a file must satisfy to open (else c10::ValueError naming the file,
// the tensor and the fault; the checks never read past the file, and no input
// crashes the process):
//  - it is a regular file of at least 8 bytes; N <= 100,000,000 and
//    8 + N <= the file's size;
//  - the header is valid UTF-8 JSON without NUL bytes (whitespace may pad
//    it; writers pad with spaces), an object whose keys are all distinct (a
//    duplicated tensor name, or a duplicated field within an entry, is
//    rejected: JSON parsers disagree on which copy wins), with objects and
//    arrays nested at most 3 deep;
//  - "__metadata__", when present, is an object of string values;
//  - every other entry is an object with "dtype" (a known dtype name), "shape"
//    (integers in [0, 2^63) whose non-zero ones, multiplied together and by
//    the element size, fit in int64, so every stride does) and
//    "data_offsets" ([begin, end], begin <= end <= the data region's size,
//    end - begin == the shape's element count * element size); other fields
//    are ignored;
//  - the tensors cover the data region exactly, as the reference
//    implementation requires: sorted by offset each begins where the previous
//    one ended, the first at 0, the last ends at the end of the file. Overlaps,
//    holes and trailing bytes are rejected.
// The data itself is not inspected (a BOOL byte other than 0 or 1 is not
// detected).
//
// Errors: malformed content raises c10::ValueError (Python: ValueError);
// failing system calls (a missing file, a full disk) raise c10::Error
// (Python: RuntimeError) naming the path and the system error.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace roundpipe {

// Tensors with their names, in a stated order.
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// One tensor of a safetensors file, as its header describes it.
struct SafetensorsTensorInfo {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  // Its bytes [begin, end) in the data region; file_offset is begin's offset
  // in the file (8 + N + begin).
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t file_offset = 0;
};

// A safetensors file, opened read-only and memory-mapped.
//
// Tensors are views of the mapping (at::from_blob, zero-copy) that keep it
// alive: they stay valid after the SafetensorsFile (and every copy of it) is
// destroyed; the mapping is removed when the last of them goes. The mapping is
// private and copy-on-write (MAP_PRIVATE | MAP_NORESERVE): writing into a
// tensor changes that process's copy of the page only, never the file, and
// costs the page's memory from then on. Pages are read from the file on first
// access and may be dropped again by the kernel while unmodified, so files
// larger than RAM can be opened. A tensor whose bytes are not aligned to its
// element size (only in files from writers that do not align; never in files
// from this writer or the reference one) is returned as an aligned copy.
//
// The file must not be truncated or rewritten in place while tensors of it
// live (reading a page the file no longer has raises SIGBUS, as for any
// mapping). save_safetensors replaces files by rename, which is safe: open
// mappings keep the old contents.
//
// Copies are cheap and share the mapping; a moved-from object may only be
// destroyed or assigned to. Thread-safety: immutable after construction;
// every member function may be called from any thread.
class SafetensorsFile {
 public:
  // Opens and maps `path` and validates its header (see the top of this
  // file). Throws c10::Error when the file cannot be opened or mapped,
  // c10::ValueError when it is malformed.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const;
  // The tensor names in the order of their bytes in the file.
  const std::vector<std::string>& names() const;
  bool contains(const std::string& name) const;
  // Throws c10::ValueError naming the file when there is no such tensor.
  const SafetensorsTensorInfo& info(const std::string& name) const;
  // The tensor `name`: a CPU tensor with requires_grad false, a view of the
  // mapping (see above). Calls for one name return views of the same bytes,
  // so a write through one is seen through the others (of this mapping, not
  // of another SafetensorsFile of the same path). Throws c10::ValueError when
  // there is no such tensor.
  at::Tensor tensor(const std::string& name) const;
  // The "__metadata__" object; empty when the file has none.
  const std::map<std::string, std::string>& metadata() const;
  // The size of the file in bytes.
  uint64_t file_size() const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// Every tensor of `path`, in the order of their bytes in the file, as views
// of one mapping (see SafetensorsFile). Errors as for SafetensorsFile.
NamedTensors load_safetensors(const std::string& path);

// Writes `tensors` and `metadata` to `path` in the safetensors format.
//
// Tensors may live on any device (each is copied to the CPU in turn while it
// is written, so the peak extra memory is one tensor) and need not be
// contiguous; they must be dense (strided layout, not quantized, with storage:
// no meta tensors) of a dtype listed above. Names must be distinct and not
// "__metadata__". The header lists "__metadata__" first (omitted when
// `metadata` is empty), then the tensors in the order of their bytes, which
// is the reference writer's order: by element size, largest first, then by
// name; so with the data region starting at a multiple of 8 (the header is
// padded with spaces) every tensor is aligned to its element size.
//
// Atomic: the bytes are streamed to a temporary file beside `path`, flushed to
// disk, and renamed over `path`; the directory is flushed too. On any failure
// (invalid input: c10::ValueError, checked before anything is written; a
// failing system call or device copy: c10::Error) the temporary file is
// removed and a previous file at `path` is unchanged.
//
// Thread-safety: concurrent calls for different paths are safe; for one path
// the last rename wins.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Sharded checkpoints (the Hugging Face layout): shard files
// "model-00001-of-00003.safetensors", ... and an index
// "model.safetensors.index.json" of the form
//   {"metadata": {"total_size": <bytes of tensor data>},
//    "weight_map": {"<tensor name>": "<shard file name>", ...}}.
inline constexpr const char* kSafetensorsIndexName = "model.safetensors.index.json";

// Writes `tensors` into `dir` (created, with its parents, when missing) as
// shards of at most `max_shard_bytes` bytes of tensor data each, plus the
// index; returns the index's path. Tensors are packed greedily in the writer's
// order (element size, largest first, then name); a tensor larger than
// `max_shard_bytes` gets a shard of its own. Every shard carries `metadata`,
// with "format": "pt" added when it has no "format" key (Hugging Face's
// loaders require it). Always writes an index, even for one shard.
//
// Each file is written atomically (see save_safetensors), the index last.
// Overwriting a checkpoint in the same directory is not atomic as a whole: a
// failure part-way leaves new shards beside the old index, and shards of an
// earlier checkpoint with more shards are not removed; write each checkpoint
// to a fresh directory when that matters.
// Throws c10::ValueError for max_shard_bytes == 0 and the errors of
// save_safetensors.
std::string save_safetensors_sharded(const std::string& dir, const NamedTensors& tensors,
                                     uint64_t max_shard_bytes,
                                     const std::map<std::string, std::string>& metadata = {});

// Every tensor listed in the index at `index_path`, sorted by name; shard file
// names are relative to the index's directory. Each shard is opened once, as a
// SafetensorsFile (views of the mappings). Throws c10::ValueError, naming the
// index, when it is not valid JSON of the form above (at most 100,000,000
// bytes; "weight_map" an object of strings; shard names relative paths
// without ".." components), when a listed tensor is missing from its shard,
// and for malformed shards. Tensors of a shard that the index does not list
// are not returned.
NamedTensors load_safetensors_index(const std::string& index_path);

// A checkpoint at `path`: a safetensors file, an index (a path ending in
// ".json"), or a directory holding kSafetensorsIndexName or, failing that,
// "model.safetensors". Throws c10::ValueError when a directory holds neither.
NamedTensors load_safetensors_checkpoint(const std::string& path);

}  // namespace roundpipe
