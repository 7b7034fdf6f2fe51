// Host memory for one download: small tensors of one dtype (and source
// device) back to back in shared host buffers, each a contiguous tensor of
// its own over its buffer. A batch of small tensors (a stage's norms, biases
// and LoRA factors, a layer's buffers, a microbatch's outputs) then costs one
// host allocation per run, not one per tensor, and an accelerator moves a run
// in one copy: a copy's fixed cost (a few us) exceeds the transfer time of a
// tensor below about 1 MiB. Larger tensors get host memory of their own, of
// their exact size (a page-locked allocator rounds each request up, and a
// part keeps its whole buffer alive).
//
// A part shares its buffer's storage with its neighbours: what acts on a
// whole storage (torch.save, share_memory_(), untyped_storage(), a resize_
// that grows it in place) sees all of it.
//
// Thread-safety: a pure function.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace roundpipe {

// Tensors below this size are gathered, into runs of at most kMaxRunBytes
// (which bounds the device memory a gather adds).
constexpr int64_t kGatherBelowBytes = int64_t{1} << 20;
constexpr int64_t kMaxRunBytes = int64_t{16} << 20;

struct DownloadBatch {
  // Per tensor of the batch, where its host copy goes (undefined where the
  // tensor is): a tensor of its own, or in a run of several a contiguous
  // tensor over the run's buffer (to autograd a tensor of its own, not a
  // view).
  std::vector<at::Tensor> host;
  // Tensors copied together: one dtype and source device, their parts back
  // to back in `into` (1-D, the run's whole buffer; undefined for a run of
  // one tensor, which is copied directly).
  struct Run {
    std::vector<size_t> members;  // indices into the batch, in buffer order
    at::Tensor into;
  };
  std::vector<Run> runs;
};

// Where a download's host memory comes from: a uint8 CPU tensor of the
// given bytes (an accelerator's page-locked block pool). Null: ordinary
// (pageable) host memory.
using HostBytes = std::function<at::Tensor(int64_t bytes)>;

// Lays out host copies of `device_tensors` in memory from `host_bytes`:
// strided tensors below `gather_below` bytes share runs of at most
// `max_run_bytes`, in batch order; every other tensor is a run of its own.
DownloadBatch plan_download(const std::vector<at::Tensor>& device_tensors, const HostBytes& host_bytes,
                            int64_t gather_below = kGatherBelowBytes, int64_t max_run_bytes = kMaxRunBytes);

}  // namespace roundpipe
