// A failed file operation: the system error and the file, so a language
// binding can raise its own kind of error (Python: OSError with errno and
// filename). To C++ callers of the public API it is a c10::Error.
//
// Thread-safety: an immutable value.
#pragma once

#include <c10/util/Exception.h>

#include <string>

namespace roundpipe {

class FileError : public c10::Error {
 public:
  // `error`: the errno; `path`: the file the operation was about; `message`:
  // the whole sentence (naming the file and the system error).
  FileError(int error, std::string path, const std::string& message);

  int error_number() const { return error_; }
  const std::string& path() const { return path_; }

 private:
  int error_;
  std::string path_;
};

// Throws FileError(error, path, message + ": " + strerror(error)).
[[noreturn]] void throw_file_error(int error, const std::string& path, const std::string& message);

}  // namespace roundpipe
