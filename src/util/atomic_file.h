// Files replaced atomically: readers (and a crash at any point) see either the
// previous content or the new one, never a mix.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "util/file_error.h"

namespace roundpipe {

// Streams bytes into a temporary file beside `path` (created when the writer
// is); commit() flushes it to disk, renames it over `path` and flushes the
// directory. A writer destroyed without a successful commit() removes the
// temporary file, so a previous file at `path` stays as it was. A `path`
// that is a symbolic link is written through: the file it points to is
// replaced, the link stays (as open() and torch.save do). Temporary files
// that writers of `path` in processes no longer running left behind (a
// crash, kill -9) are removed when the next writer of `path` starts. Every
// failing system call throws FileError naming the file and the system
// error. Thread-compatible (one writer, one thread at a time); temporary
// names are unique per process and writer, so writers of one path on
// several threads never share one.
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
  // The file that commit() replaces (`path`, or what the link points to).
  const std::string& target() const { return path_; }

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

// Fault injection for tests (leveldb's fault-injection Env is the model):
// every system call an AtomicFileWriter makes on its file asks the injector
// first, with the call and the file (the temporary one, or the target for
// kRename). The injector returns 0 to let the call run, an errno to make it
// fail with that error, or kShortWrite (kWrite only) to let it write half
// of its bytes, as a real short write does. Process-wide, for every writer;
// an empty function (the default) injects nothing.
enum class FileCall { kCreate, kWrite, kSync, kClose, kRename };
constexpr int kShortWrite = -1;
using FileFaultInjector = std::function<int(FileCall call, const std::string& path)>;
void set_file_fault_injector(FileFaultInjector injector);

}  // namespace roundpipe
