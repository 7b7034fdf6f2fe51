// runtime/cuda_memory.h without CUDA (built against a CPU-only torch).
#include <c10/util/Exception.h>

#include "runtime/cuda_memory.h"

namespace roundpipe {
namespace cuda {
namespace {

[[noreturn]] void unavailable(const char* what) {
  TORCH_CHECK(false, what,
              ": roundpipe was built against a torch without CUDA; "
              "install a CUDA build of torch and rebuild roundpipe");
}

}  // namespace

bool built_with_cuda() { return false; }
at::Tensor page_locked_bytes(int64_t) { unavailable("page_locked_bytes"); }
bool register_page_locked(void*, int64_t) { unavailable("register_page_locked"); }
void unregister_page_locked(void*) {}
int64_t page_locked_host_bytes() { return 0; }
int64_t allocated_bytes(int) { unavailable("allocated_bytes"); }
int64_t peak_allocated_bytes(int) { unavailable("peak_allocated_bytes"); }
int64_t peak_reserved_bytes(int) { unavailable("peak_reserved_bytes"); }
void reset_peak_allocated_bytes(int) { unavailable("reset_peak_allocated_bytes"); }

}  // namespace cuda
}  // namespace roundpipe
