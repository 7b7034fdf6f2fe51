#include "engine/checkpoint_file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>


namespace roundpipe {
namespace detail {
namespace {

constexpr char kHead[8] = {'R', 'P', 'C', 'K', 'P', 'T', '0', '1'};
constexpr char kTail[8] = {'R', 'P', 'C', 'K', 'E', 'N', 'D', '1'};
constexpr size_t kTrailer = 24;  // archive bytes, hash, kTail

constexpr uint64_t kP1 = 11400714785074694791ULL, kP2 = 14029467366897019727ULL,
                   kP3 = 1609587929392839161ULL, kP5 = 2870177450012600261ULL;

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t round64(uint64_t acc, uint64_t in) { return rotl(acc + in * kP2, 31) * kP1; }

uint64_t load_le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void store_le64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

std::mutex& hook_mu() {
  static std::mutex mu;
  return mu;
}

CheckpointCrashHook& crash_hook() {
  static CheckpointCrashHook hook;
  return hook;
}

void at_point(const char* point, uint64_t bytes) {
  CheckpointCrashHook hook;
  {
    std::lock_guard<std::mutex> lock(hook_mu());
    hook = crash_hook();
  }
  if (hook) hook(point, bytes);
}

[[noreturn]] void damaged(const std::string& path, const std::string& what) {
  TORCH_CHECK_VALUE(false, "load_checkpoint: '", path, "' is not a valid roundpipe checkpoint (", what,
                    "); it may be truncated or corrupt: load an earlier checkpoint");
}

// Reads exactly `size` bytes at `offset`; false at the end of the file.
bool pread_all(int fd, void* buf, size_t size, uint64_t offset) {
  char* p = static_cast<char*>(buf);
  while (size > 0) {
    const ssize_t n = ::pread(fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return true;
}

}  // namespace

void set_checkpoint_crash_hook(CheckpointCrashHook hook) {
  std::lock_guard<std::mutex> lock(hook_mu());
  crash_hook() = std::move(hook);
}

Hash64::Hash64() : lanes_{kP1 + kP2, kP2, 0, 0 - kP1} {}

void Hash64::block(const unsigned char* p) {
  for (int i = 0; i < 4; ++i) lanes_[i] = round64(lanes_[i], load_le64(p + 8 * i));
}

void Hash64::update(const void* data, size_t size) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  total_ += size;
  if (num_pending_ > 0) {
    const size_t take = std::min(size, sizeof(pending_) - num_pending_);
    std::memcpy(pending_ + num_pending_, p, take);
    num_pending_ += take;
    p += take;
    size -= take;
    if (num_pending_ < sizeof(pending_)) return;
    block(pending_);
    num_pending_ = 0;
  }
  for (; size >= sizeof(pending_); p += sizeof(pending_), size -= sizeof(pending_)) block(p);
  std::memcpy(pending_, p, size);
  num_pending_ = size;
}

uint64_t Hash64::digest() const {
  uint64_t h = rotl(lanes_[0], 1) + rotl(lanes_[1], 7) + rotl(lanes_[2], 12) + rotl(lanes_[3], 18) + total_;
  for (size_t i = 0; i < num_pending_; ++i) h = rotl(h ^ (pending_[i] * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  return h ^ (h >> 32);
}

CheckpointFileWriter::CheckpointFileWriter(const std::string& path) : file_(path, &at_point) {
  write_raw(kHead, sizeof(kHead));
  check_written();
}

void CheckpointFileWriter::write_raw(const void* data, size_t size) {
  if (error_ || discarding_) return;
  try {
    file_.write(data, size);
  } catch (...) {
    error_ = std::current_exception();
  }
}

size_t CheckpointFileWriter::write(const void* data, size_t size) {
  write_raw(data, size);
  hash_.update(data, size);
  bytes_ += size;
  return size;
}

void CheckpointFileWriter::check_written() const {
  if (error_) std::rethrow_exception(error_);
}

void CheckpointFileWriter::commit() {
  TORCH_CHECK(!committed_, "save_checkpoint: the checkpoint was already committed");
  TORCH_CHECK(!discarding_, "save_checkpoint: the checkpoint was interrupted");
  unsigned char trailer[kTrailer];
  store_le64(trailer, bytes_);
  store_le64(trailer + 8, hash_.digest());
  std::memcpy(trailer + 16, kTail, sizeof(kTail));
  write_raw(trailer, sizeof(trailer));
  check_written();
  committed_ = true;
  file_.commit();
}

void read_checkpoint_file(const std::string& path, torch::serialize::InputArchive& ar) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK_VALUE(fd >= 0, "load_checkpoint: cannot open '", path, "': ", std::strerror(errno));
  std::unique_ptr<int, void (*)(int*)> closer(new int(fd), [](int* f) {
    ::close(*f);
    delete f;
  });
  struct stat st;
  TORCH_CHECK_VALUE(::fstat(fd, &st) == 0 && S_ISREG(st.st_mode), "load_checkpoint: '", path,
                    "' is not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < sizeof(kHead) + kTrailer) damaged(path, "it is only " + std::to_string(size) + " bytes long");
  char head[sizeof(kHead)];
  unsigned char trailer[kTrailer];
  if (!pread_all(fd, head, sizeof(head), 0) || std::memcmp(head, kHead, sizeof(kHead)) != 0) {
    damaged(path, "it does not start with the checkpoint tag");
  }
  if (!pread_all(fd, trailer, sizeof(trailer), size - kTrailer) ||
      std::memcmp(trailer + 16, kTail, sizeof(kTail)) != 0) {
    damaged(path, "it does not end with the checkpoint trailer: the save did not finish");
  }
  const uint64_t archive = load_le64(trailer);
  if (archive != size - sizeof(kHead) - kTrailer) {
    damaged(path, "its length " + std::to_string(size) + " does not match its trailer");
  }
  // One pass over the bytes before trusting any of them.
  Hash64 hash;
  std::vector<char> buf(size_t{1} << 20);
  for (uint64_t done = 0; done < archive;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), archive - done));
    if (!pread_all(fd, buf.data(), n, sizeof(kHead) + done)) damaged(path, "it cannot be read to its end");
    hash.update(buf.data(), n);
    done += n;
  }
  if (hash.digest() != load_le64(trailer + 8)) damaged(path, "its bytes do not match their hash");
  try {
    ar.load_from(
        [fd, archive](uint64_t pos, void* out, size_t n) -> size_t {
          if (pos >= archive) return 0;
          n = static_cast<size_t>(std::min<uint64_t>(n, archive - pos));
          return pread_all(fd, out, n, sizeof(kHead) + pos) ? n : 0;
        },
        [archive]() -> size_t { return static_cast<size_t>(archive); });
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    damaged(path, c10_error != nullptr ? c10_error->what_without_backtrace() : e.what());
  }
}

}  // namespace detail
}  // namespace roundpipe
