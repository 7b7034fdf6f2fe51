#include "runtime/download_batch.h"

#include <ATen/ATen.h>

#include <map>
#include <tuple>
#include <utility>

#include "runtime/tensor_over.h"

namespace roundpipe {

DownloadBatch plan_download(const std::vector<at::Tensor>& device_tensors, const HostBytes& host_bytes,
                            int64_t gather_below, int64_t max_run_bytes) {
  DownloadBatch batch;
  batch.host.resize(device_tensors.size());
  // The run being filled per (source device, dtype): its index in
  // batch.runs and its bytes so far.
  std::map<std::tuple<int, int, int>, std::pair<size_t, int64_t>> open;
  for (size_t i = 0; i < device_tensors.size(); ++i) {
    const at::Tensor& t = device_tensors[i];
    if (!t.defined()) continue;
    const auto bytes = static_cast<int64_t>(t.nbytes());
    if (t.layout() == at::kStrided && bytes < gather_below) {
      const auto key = std::make_tuple(static_cast<int>(t.device().type()), static_cast<int>(t.device().index()),
                                       static_cast<int>(t.scalar_type()));
      auto it = open.find(key);
      if (it != open.end() && it->second.second + bytes <= max_run_bytes) {
        batch.runs[it->second.first].members.push_back(i);
        it->second.second += bytes;
        continue;
      }
      open[key] = {batch.runs.size(), bytes};
    }
    batch.runs.push_back({{i}, at::Tensor()});
  }
  // `numel` elements of `dtype` in memory of their own.
  auto host_memory = [&](at::ScalarType dtype, int64_t numel) {
    if (!host_bytes || numel == 0) return at::empty({numel}, at::TensorOptions().dtype(dtype));
    return tensor_over(host_bytes(numel * static_cast<int64_t>(c10::elementSize(dtype))),
                       c10::scalarTypeToTypeMeta(dtype), 0, {numel});
  };
  for (DownloadBatch::Run& run : batch.runs) {
    const at::Tensor& first = device_tensors[run.members.front()];
    if (run.members.size() == 1) {  // memory of its own, of its exact size
      at::Tensor& host = batch.host[run.members.front()];
      if (host_bytes && first.layout() == at::kStrided) {
        const at::Tensor memory = host_memory(first.scalar_type(), first.numel());
        host = tensor_over(memory, memory.dtype(), 0, first.sizes());
      } else {
        host = at::empty(first.sizes(), first.options().device(at::kCPU).memory_format(at::MemoryFormat::Contiguous));
      }
      continue;
    }
    int64_t numel = 0;
    for (size_t i : run.members) numel += device_tensors[i].numel();
    run.into = host_memory(first.scalar_type(), numel);
    int64_t offset = 0;
    for (size_t i : run.members) {
      batch.host[i] = tensor_over(run.into, run.into.dtype(), offset, device_tensors[i].sizes());
      offset += device_tensors[i].numel();
    }
  }
  return batch;
}

}  // namespace roundpipe
