#include "util/atomic_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

namespace roundpipe {

namespace {

std::mutex& injector_mu() {
  static std::mutex mu;
  return mu;
}

FileFaultInjector& injector() {
  static FileFaultInjector fn;
  return fn;
}

// The injector's answer for `call` on `path` (0: run the call).
int injected(FileCall call, const std::string& path) {
  FileFaultInjector fn;
  {
    std::lock_guard<std::mutex> lock(injector_mu());
    fn = injector();
  }
  return fn ? fn(call, path) : 0;
}

std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_name_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// `path`, or the file its chain of symbolic links ends at (which need not
// exist yet).
std::string resolve_links(std::string path) {
  for (int hops = 0; hops < 40; ++hops) {  // Linux's own limit on a chain
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return path;
    std::vector<char> buf(static_cast<size_t>(std::max<off_t>(st.st_size, 255)) + 1);
    const ssize_t n = ::readlink(path.c_str(), buf.data(), buf.size() - 1);
    if (n <= 0) return path;
    std::string target(buf.data(), static_cast<size_t>(n));
    path = target.front() == '/' ? target : directory_of(path) + "/" + target;
  }
  throw_file_error(ELOOP, path, "cannot write '" + path + "'");
}

std::string tmp_prefix(const std::string& path) { return base_name_of(path) + ".tmp."; }

std::string unique_tmp_name(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return directory_of(path) + "/" + tmp_prefix(path) + std::to_string(::getpid()) + "." +
         std::to_string(counter++);
}

// Removes "<name>.tmp.<pid>.<n>" beside `path` for every pid that is no
// longer a running process: what a writer killed before its commit left.
void remove_stale_tmp_files(const std::string& path) {
  const std::string dir = directory_of(path), prefix = tmp_prefix(path);
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string rest = name.substr(prefix.size());
    const auto dot = rest.find('.');
    if (dot == 0 || dot == std::string::npos ||
        rest.find_first_not_of("0123456789.") != std::string::npos) {
      continue;
    }
    const long pid = std::strtol(rest.substr(0, dot).c_str(), nullptr, 10);
    if (pid <= 0 || pid == ::getpid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) stale.push_back(dir + "/" + name);
  }
  ::closedir(d);
  for (const std::string& f : stale) ::unlink(f.c_str());
}

}  // namespace

void set_file_fault_injector(FileFaultInjector fn) {
  std::lock_guard<std::mutex> lock(injector_mu());
  injector() = std::move(fn);
}

AtomicFileWriter::AtomicFileWriter(const std::string& path, StepObserver observer)
    : observer_(std::move(observer)) {
  TORCH_CHECK_VALUE(!path.empty(), "cannot write a file: the path is empty");
  path_ = resolve_links(path);
  remove_stale_tmp_files(path_);
  tmp_ = unique_tmp_name(path_);
  const int fault = injected(FileCall::kCreate, tmp_);
  fd_ = fault != 0 ? -1 : ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw_file_error(fault != 0 ? fault : errno, path_,
                     "cannot create '" + tmp_ + "' (to write '" + path_ + "')");
  }
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
    size_t len = std::min(size, kChunk);
    const int fault = injected(FileCall::kWrite, tmp_);
    if (fault == kShortWrite) len = std::max<size_t>(len / 2, 1);
    const ssize_t n = fault > 0 ? (errno = fault, -1) : ::write(fd_, p, len);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // A write that makes no progress (n == 0) is treated as a full disk.
      throw_file_error(n < 0 ? errno : ENOSPC, path_,
                       "cannot write '" + tmp_ + "' (to write '" + path_ + "')");
    }
    p += n;
    size -= static_cast<size_t>(n);
    bytes_ += static_cast<uint64_t>(n);
  }
  observe("write");
}

void AtomicFileWriter::commit() {
  TORCH_CHECK(fd_ >= 0, "cannot write '", path_, "': the file was already committed");
  observe("fsync");
  int fault = injected(FileCall::kSync, tmp_);
  if (fault != 0 || ::fsync(fd_) != 0) {
    throw_file_error(fault != 0 ? fault : errno, path_, "cannot flush '" + tmp_ + "' to disk");
  }
  const int fd = fd_;
  fd_ = -1;
  fault = injected(FileCall::kClose, tmp_);
  if (::close(fd) != 0 || fault != 0) {
    const int err = fault != 0 ? fault : errno;
    ::unlink(tmp_.c_str());
    throw_file_error(err, path_, "cannot close '" + tmp_ + "'");
  }
  observe("rename");
  fault = injected(FileCall::kRename, path_);
  if (fault != 0 || ::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = fault != 0 ? fault : errno;
    ::unlink(tmp_.c_str());
    throw_file_error(err, path_, "cannot rename '" + tmp_ + "' to '" + path_ + "'");
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
