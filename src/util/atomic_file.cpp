#include "util/atomic_file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

namespace roundpipe {

namespace {

std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string unique_tmp_name(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
}

}  // namespace

AtomicFileWriter::AtomicFileWriter(const std::string& path, StepObserver observer)
    : path_(path), observer_(std::move(observer)) {
  TORCH_CHECK(!path.empty(), "cannot write a file: the path is empty");
  tmp_ = unique_tmp_name(path);
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "cannot create '", tmp_, "' (to write '", path,
              "'): ", std::strerror(errno));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFileWriter::write(const void* data, size_t size) {
  TORCH_CHECK(fd_ >= 0, "cannot write '", path_, "': the file was already committed");
  const char* p = static_cast<const char*>(data);
  constexpr size_t kChunk = size_t{1} << 30;  // write(2) moves at most ~2 GiB per call
  while (size > 0) {
    const ssize_t n = ::write(fd_, p, std::min(size, kChunk));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "cannot write '", tmp_, "' (to write '", path_,
                "'): ", n < 0 ? std::strerror(errno) : "no progress");
    p += n;
    size -= static_cast<size_t>(n);
    bytes_ += static_cast<uint64_t>(n);
  }
  observe("write");
}

void AtomicFileWriter::commit() {
  TORCH_CHECK(fd_ >= 0, "cannot write '", path_, "': the file was already committed");
  observe("fsync");
  TORCH_CHECK(::fsync(fd_) == 0, "cannot flush '", tmp_, "' to disk: ", std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    TORCH_CHECK(false, "cannot close '", tmp_, "': ", std::strerror(err));
  }
  observe("rename");
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    TORCH_CHECK(false, "cannot rename '", tmp_, "' to '", path_, "': ", std::strerror(err));
  }
  observe("renamed");
  // The rename is durable once the directory entry is.
  const int dir = ::open(directory_of(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

void write_file_atomically(const std::string& path, const std::string& data) {
  AtomicFileWriter file(path);
  file.write(data.data(), data.size());
  file.commit();
}

}  // namespace roundpipe
