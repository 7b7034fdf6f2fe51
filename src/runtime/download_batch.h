// Host memory for one download: the tensors of each dtype back to back in
// one host buffer, each tensor a contiguous part of it. A batch (a stage's
// gradients, a layer's buffers, a microbatch's outputs) then costs one host
// allocation per dtype, not one per tensor, and an accelerator can move
// neighbouring small tensors in one copy: a copy's fixed cost (a few us)
// exceeds the transfer time of a tensor below about 1 MiB.
//
// Thread-safety: a pure function.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace roundpipe {

struct DownloadBatch {
  // Per tensor of the batch, where its host copy goes (undefined where the
  // tensor is). Strided tensors get contiguous parts of their dtype's buffer
  // (tensors of their own to autograd, not views), others a host tensor of
  // their own.
  std::vector<at::Tensor> host;
  // Tensors copied together, in order: their parts are consecutive in one
  // buffer, and `into` is the range of the buffer they fill.
  struct Run {
    std::vector<size_t> members;  // indices into the batch
    at::Tensor into;              // 1-D; undefined for a tensor that is not strided
  };
  std::vector<Run> runs;
};

// Lays out host copies of `device_tensors` (page-locked when `pinned`).
// Strided tensors below `gather_below` bytes share runs of at most
// `max_run_bytes`, placed first in their buffer in batch order; every other
// tensor is a run of its own. `gather_below` 0: every tensor alone.
DownloadBatch plan_download(const std::vector<at::Tensor>& device_tensors, bool pinned, int64_t gather_below,
                            int64_t max_run_bytes);

}  // namespace roundpipe
