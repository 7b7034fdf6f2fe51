// Files replaced atomically: readers (and a crash at any point) see either the
// previous content or the new one, never a mix.
#pragma once

#include <string>

namespace roundpipe {

// Writes `data` to a temporary file beside `path`, flushes it to disk, renames
// it over `path` and flushes the directory. Throws std::runtime_error naming
// the path and the system error when any step fails; the previous file at
// `path` is then unchanged and the temporary file removed.
void write_file_atomically(const std::string& path, const std::string& data);

}  // namespace roundpipe
