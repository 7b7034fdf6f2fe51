// The per-ISA kernel tables behind kernels.h. Each table is defined in its own
// translation unit (scalar.cpp, avx2.cpp, avx512.cpp) compiled with that ISA's
// flags; they work on one element range [begin, end) on the calling thread.
#pragma once

#include <cstdint>

#include "optim/kernels/kernels.h"

namespace roundpipe {
namespace optim {
namespace kernels {
namespace detail {

struct KernelTable {
  void (*adam)(const AdamHyper& hyper, const AdamBuffers& buffers, int64_t begin, int64_t end);
  void (*sgd)(const SgdHyper& hyper, const SgdBuffers& buffers, int64_t begin, int64_t end);
  // Returns whether any of grad[begin, end) was inf or NaN before scaling.
  bool (*unscale_and_check)(float* grad, int64_t begin, int64_t end, float inv_scale);
  void (*convert_to_lowp)(const float* src, uint16_t* dst, int64_t begin, int64_t end,
                          LowpKind kind);
  // The compact-state functions work on whole blocks: begin is a multiple of
  // kBlockwise8BlockSize, and so is end unless it is the end of the arrays
  // (only the last block is short). For the other formats any range will do.
  void (*adam_compact)(const AdamHyper& hyper, const CompactAdamBuffers& buffers, int64_t begin,
                       int64_t end);
  void (*quantize_blockwise8)(const float* src, uint8_t* codes, float* absmax, int64_t begin,
                              int64_t end, bool is_signed);
  void (*dequantize_blockwise8)(const uint8_t* codes, const float* absmax, float* dst,
                                int64_t begin, int64_t end, bool is_signed);
};

const KernelTable* scalar_kernels();
// Null when this build has no such code (a non-x86 target).
const KernelTable* avx2_kernels();
// With AVX512-VBMI byte lookups where the CPU has them; both AVX-512 tables
// give bitwise the same results.
const KernelTable* avx512_kernels();
const KernelTable* avx512_kernels_without_vbmi();

}  // namespace detail
}  // namespace kernels
}  // namespace optim
}  // namespace roundpipe
