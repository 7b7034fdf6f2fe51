// Files for weights: a read-only memory mapping (their writer is
// util/atomic_file.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace roundpipe {

// A whole regular file mapped private and copy-on-write
// (PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE): writes change this
// process's pages only, never the file, and a mapping larger than RAM needs
// no memory reservation. Throws c10::Error naming the path and the system
// error when the file cannot be opened, is not a regular file, or cannot be
// mapped. An empty file has no mapping (data() is null, size() 0).
// Thread-compatible; the mapping is immutable unless a caller writes to it.
class FileMapping {
 public:
  explicit FileMapping(const std::string& path);
  ~FileMapping();
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;

  unsigned char* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  unsigned char* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace roundpipe
