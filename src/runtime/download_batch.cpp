#include "runtime/download_batch.h"

#include <ATen/ATen.h>

#include <map>
#include <tuple>
#include <utility>

#include "runtime/tensor_over.h"

namespace roundpipe {

DownloadBatch plan_download(const std::vector<at::Tensor>& device_tensors, bool pinned, int64_t gather_below,
                            int64_t max_run_bytes) {
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
  for (DownloadBatch::Run& run : batch.runs) {
    const at::Tensor& first = device_tensors[run.members.front()];
    if (run.members.size() == 1) {  // memory of its own, of its exact size
      batch.host[run.members.front()] =
          at::empty(first.sizes(), first.options().device(at::kCPU).memory_format(at::MemoryFormat::Contiguous)
                                       .pinned_memory(pinned));
      continue;
    }
    int64_t numel = 0;
    for (size_t i : run.members) numel += device_tensors[i].numel();
    run.into = at::empty({numel}, at::TensorOptions().dtype(first.scalar_type()).pinned_memory(pinned));
    int64_t offset = 0;
    for (size_t i : run.members) {
      batch.host[i] = tensor_over(run.into, run.into.dtype(), offset, device_tensors[i].sizes());
      offset += device_tensors[i].numel();
    }
  }
  return batch;
}

}  // namespace roundpipe
