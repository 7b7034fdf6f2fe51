#include "runtime/download_batch.h"

#include <ATen/ATen.h>

#include <map>
#include <tuple>

namespace roundpipe {
namespace {

// A contiguous tensor of `sizes` over `buffer`'s memory from element
// `offset`, which is not a view in autograd's sense: like any tensor of its
// own it may be detached or changed in place, also as the output of an
// autograd function or a parameter's .grad. Built directly (no dispatched
// op): a stage's download makes one per gradient.
at::Tensor part_of(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(buffer.storage()), buffer.key_set(), buffer.dtype());
  impl->set_storage_offset(offset);
  impl->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(impl));
}

}  // namespace

DownloadBatch plan_download(const std::vector<at::Tensor>& device_tensors, bool pinned, int64_t gather_below,
                            int64_t max_run_bytes) {
  DownloadBatch batch;
  batch.host.resize(device_tensors.size());
  // Runs being filled, one per (source device, dtype): their members and bytes.
  std::map<std::tuple<int, int, int>, size_t> open;  // -> index in batch.runs
  std::vector<int64_t> run_bytes;
  for (size_t i = 0; i < device_tensors.size(); ++i) {
    const at::Tensor& t = device_tensors[i];
    if (!t.defined()) continue;
    const auto bytes = static_cast<int64_t>(t.nbytes());
    const bool small = t.layout() == at::kStrided && bytes < gather_below;
    if (small) {
      const auto key = std::make_tuple(static_cast<int>(t.device().type()), static_cast<int>(t.device().index()),
                                       static_cast<int>(t.scalar_type()));
      auto it = open.find(key);
      if (it != open.end() && run_bytes[it->second] + bytes <= max_run_bytes) {
        batch.runs[it->second].members.push_back(i);
        run_bytes[it->second] += bytes;
        continue;
      }
      open[key] = batch.runs.size();
    }
    batch.runs.push_back({{i}, at::Tensor()});
    run_bytes.push_back(bytes);
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
      batch.host[i] = part_of(run.into, offset, device_tensors[i].sizes());
      offset += device_tensors[i].numel();
    }
  }
  return batch;
}

}  // namespace roundpipe
