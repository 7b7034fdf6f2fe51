#include "util/file_error.h"

#include <cstring>
#include <utility>

namespace roundpipe {

FileError::FileError(int error, std::string path, const std::string& message)
    : c10::Error(message, /*backtrace=*/nullptr), error_(error), path_(std::move(path)) {}

void throw_file_error(int error, const std::string& path, const std::string& message) {
  throw FileError(error, path, message + ": " + std::strerror(error));
}

}  // namespace roundpipe
