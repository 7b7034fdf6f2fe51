// The checkpoint file: a frame around one libtorch archive (zip),
//   "RPCKPT01" | archive | u64 archive bytes | u64 hash of the archive | "RPCKEND1"
// (integers little-endian). The archive checks its own structure but not the
// bytes of its tensors: the hash (64-bit, xxHash64-style) catches a damaged
// byte anywhere, the trailer a truncation.
#pragma once

#include <torch/serialize/input-archive.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>

#include "util/atomic_file.h"

namespace roundpipe {
namespace detail {

// Called by the checkpoint writer at each point it passes: "write" after each
// chunk (bytes: written so far), "fsync" before flushing the file, "rename"
// before renaming it over the target, "renamed" after; tests make the
// process die there. Process-wide; null (default) for none.
using CheckpointCrashHook = std::function<void(const char* point, uint64_t bytes)>;
void set_checkpoint_crash_hook(CheckpointCrashHook hook);

// A 64-bit hash of a byte stream in the style of xxHash64 (not bit-compatible
// with it); the result does not depend on how the stream is cut into
// update() calls.
class Hash64 {
 public:
  Hash64();
  void update(const void* data, size_t size);
  uint64_t digest() const;

 private:
  void block(const unsigned char* p);

  uint64_t lanes_[4];
  unsigned char pending_[32];
  size_t num_pending_ = 0;
  uint64_t total_ = 0;
};

// Streams a framed archive into `path` through an AtomicFileWriter (a
// temporary file, flushed and renamed over `path` by commit(); removed when
// destroyed uncommitted), which reports its steps to the crash hook
// (set_checkpoint_crash_hook). Errors: FileError naming the file and the system
// error.
class CheckpointFileWriter {
 public:
  explicit CheckpointFileWriter(const std::string& path);
  CheckpointFileWriter(const CheckpointFileWriter&) = delete;
  CheckpointFileWriter& operator=(const CheckpointFileWriter&) = delete;

  // Archive bytes. The archive writer calls this from C code and must never
  // see a short count (libtorch's writer then throws again from its
  // destructor, which ends the process), so every call reports all bytes
  // taken: after a failure, or once discard() was called, the bytes are
  // dropped and check_written() throws the first failure afterwards.
  size_t write(const void* data, size_t size);
  // Drops every later byte (an interrupted save runs the archive to its end).
  void discard() { discarding_ = true; }
  void check_written() const;
  // Writes the trailer and replaces `path`.
  void commit();

 private:
  void write_raw(const void* data, size_t size);

  AtomicFileWriter file_;
  bool committed_ = false;
  bool discarding_ = false;
  uint64_t bytes_ = 0;  // archive bytes written
  Hash64 hash_;         // of the archive bytes
  std::exception_ptr error_;
};

// Checks the frame and the hash of the file at `path`, then loads its
// archive into `ar`. c10::ValueError naming the file for a missing,
// truncated, damaged or foreign file.
void read_checkpoint_file(const std::string& path, torch::serialize::InputArchive& ar);

}  // namespace detail
}  // namespace roundpipe
