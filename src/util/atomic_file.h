// Files replaced atomically: readers (and a crash at any point) see either the
// previous content or the new one, never a mix.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace roundpipe {

// Streams bytes into a temporary file beside `path` (created when the writer
// is); commit() flushes it to disk, renames it over `path` and flushes the
// directory. A writer destroyed without a successful commit() removes the
// temporary file, so a previous file at `path` stays as it was. Every failing
// system call throws c10::Error naming the file and the system error.
// Thread-compatible (one writer, one thread at a time); temporary names are
// unique per process and writer, so writers of one path on several threads
// never share one.
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

// Writes `data` to `path` through an AtomicFileWriter.
void write_file_atomically(const std::string& path, const std::string& data);

}  // namespace roundpipe
