#include "runtime/download_batch.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>

namespace roundpipe {
namespace {

// A contiguous tensor of `sizes` over `buffer`'s memory from element
// `offset`, which is not a view in autograd's sense: like any tensor of its
// own it may be detached or changed in place, also as the output of an
// autograd function or a parameter's .grad.
at::Tensor part_of(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= std::max<int64_t>(sizes[d], 1);
  }
  return at::empty({0}, buffer.options()).set_(buffer.storage(), offset, sizes, strides);
}

}  // namespace

DownloadBatch plan_download(const std::vector<at::Tensor>& device_tensors, bool pinned, int64_t gather_below,
                            int64_t max_run_bytes) {
  DownloadBatch batch;
  batch.host.resize(device_tensors.size());
  // Per dtype, its members in buffer order: small ones first, then the rest.
  std::map<at::ScalarType, std::vector<size_t>> by_dtype;
  for (size_t i = 0; i < device_tensors.size(); ++i) {
    const at::Tensor& t = device_tensors[i];
    if (!t.defined()) continue;
    if (t.layout() != at::kStrided) {
      batch.host[i] = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(pinned));
      batch.runs.push_back({{i}, at::Tensor()});
      continue;
    }
    by_dtype[t.scalar_type()].push_back(i);
  }
  for (auto& [dtype, members] : by_dtype) {
    auto small = [&](size_t i) { return static_cast<int64_t>(device_tensors[i].nbytes()) < gather_below; };
    std::stable_partition(members.begin(), members.end(), small);
    int64_t numel = 0;
    for (size_t i : members) numel += device_tensors[i].numel();
    const at::Tensor buffer = at::empty({numel}, at::TensorOptions().dtype(dtype).pinned_memory(pinned));
    int64_t offset = 0;
    int64_t run_begin = 0;
    int64_t run_bytes = 0;
    bool open = false;        // a run of this buffer is being filled
    bool open_small = false;  // ... and small tensors may join it
    auto close_run = [&] {
      if (open) batch.runs.back().into = buffer.narrow(0, run_begin, offset - run_begin);
    };
    for (size_t i : members) {
      const at::Tensor& t = device_tensors[i];
      const auto bytes = static_cast<int64_t>(t.nbytes());
      if (!(small(i) && open_small && run_bytes + bytes <= max_run_bytes)) {
        close_run();
        batch.runs.push_back({{}, at::Tensor()});
        open = true;
        run_begin = offset;
        run_bytes = 0;
      }
      batch.runs.back().members.push_back(i);
      batch.host[i] = part_of(buffer, offset, t.sizes());
      offset += t.numel();
      run_bytes += bytes;
      open_small = small(i);
    }
    close_run();
  }
  return batch;
}

}  // namespace roundpipe
