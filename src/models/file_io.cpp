#include "models/file_io.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

namespace roundpipe {

FileMapping::FileMapping(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open '", path, "': ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    TORCH_CHECK(false, "cannot stat '", path, "': ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    TORCH_CHECK(false, "cannot map '", path, "': not a regular file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ > 0) {
    if (size_ > std::numeric_limits<size_t>::max()) {
      ::close(fd);
      TORCH_CHECK(false, "cannot map '", path, "': the file is larger than the address space");
    }
    void* p = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      TORCH_CHECK(false, "cannot map '", path, "' (", size_, " bytes): ", std::strerror(err));
    }
    data_ = static_cast<unsigned char*>(p);
  }
  ::close(fd);  // the mapping keeps the file
}

FileMapping::~FileMapping() {
  if (data_ != nullptr) ::munmap(data_, static_cast<size_t>(size_));
}

}  // namespace roundpipe
