// Files for weights: a read-only memory mapping, and a writer that streams to
// a temporary file and replaces its target atomically.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
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

// Streams bytes into a temporary file beside `path` (created when the writer
// is); commit() flushes it to disk, renames it over `path` and flushes the
// directory. A writer destroyed without a successful commit() removes the
// temporary file, so a previous file at `path` stays as it was. Every failing
// system call throws c10::Error naming the file and the system error.
// Thread-compatible (one writer, one thread at a time); temporary names are
// unique per process and writer.
class AtomicFileWriter {
 public:
  // Told each step with the bytes written so far: "write" after each
  // write(), "fsync" before flushing, "rename" before renaming, "renamed"
  // after. Crash tests make the process die there.
  using StepObserver = std::function<void(const char* step, uint64_t bytes)>;

  explicit AtomicFileWriter(const std::string& path, StepObserver observer = nullptr);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, size_t size);
  void commit();

 private:
  void observe(const char* step) const {
    if (observer_) observer_(step, bytes_);
  }

  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  uint64_t bytes_ = 0;
  StepObserver observer_;
};

}  // namespace roundpipe
