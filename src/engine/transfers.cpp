#include "engine/transfers.h"

#include <unordered_map>

#include "engine/host_store.h"
#include "util/value_tree.h"

namespace roundpipe {

namespace {

// Completes once the parameters of the given layers hold write
// `generation`: the parameter-upload lane waits for it (Device::lane_wait),
// not the worker, which goes on queueing compute.
// Also after the downloads of the buffers it reads from an earlier call.
class ParamGateFence final : public Fence {
 public:
  ParamGateFence(const ParamGate* gate, std::vector<int64_t> layers, int64_t generation,
                 std::vector<FencePtr> buffers_downloaded)
      : gate_(gate), layers_(std::move(layers)), generation_(generation),
        buffers_downloaded_(std::move(buffers_downloaded)) {}
  void synchronize() const override {
    for (int64_t l : layers_) gate_->wait(l, generation_);
    for (const FencePtr& f : buffers_downloaded_) f->synchronize();
  }
  bool query() const override {
    for (int64_t l : layers_) {
      if (!gate_->written(l, generation_)) return false;
    }
    for (const FencePtr& f : buffers_downloaded_) {
      if (!f->query()) return false;
    }
    return true;
  }

 private:
  const ParamGate* gate_;  // outlives the call, which waits for its copies
  std::vector<int64_t> layers_;
  int64_t generation_;
  std::vector<FencePtr> buffers_downloaded_;
};

}  // namespace

OnDevice to_device(Device& dev, const Slot& slot) {
  if (slot.device == dev.index()) return OnDevice{slot.value, slot.fence};
  std::vector<at::Tensor> host = flatten_tensors(slot.value);
  if (host.empty()) return OnDevice{slot.value, nullptr};
  std::vector<at::Tensor> moved = dev.upload(host, Lane::kActUpload, slot.fence);
  return OnDevice{replace_tensors(slot.value, moved), dev.lane_fence(Lane::kActUpload)};
}

Slot hand_off(Device& dev, const c10::IValue& value, int64_t consumer) {
  Slot out;
  if (consumer == dev.index()) {
    // Read by later compute of the same device: ordered by its lane already.
    out.value = value;
    out.device = dev.index();
    return out;
  }
  std::vector<at::Tensor> tensors = flatten_tensors(value);
  if (tensors.empty()) {
    out.value = value;
    return out;
  }
  out.value = replace_tensors(value, dev.download(tensors));
  out.fence = dev.lane_fence(Lane::kDownload);
  return out;
}

StageTensors upload_stage(Device& dev, const ModelView& model, LayerRange range, bool timed) {
  const HostStore& store = *model.store;
  const std::vector<std::shared_ptr<LayerHandle>>& layers = *model.layers;
  std::vector<at::Tensor> host;  // what to upload
  std::vector<int64_t> gated;    // layers whose parameters it reads
  std::unordered_map<int64_t, std::pair<size_t, bool>> source;  // param id -> (index in host, arena?)
  // The stage's arenas: one range of the slab, one copy. Parameters left in
  // place (no slab) go one by one.
  const at::Tensor& slab = store.slab();
  const int64_t slab_begin = store.layer(range.begin).slab_offset;
  const int64_t slab_end = store.layer(range.end - 1).slab_offset + store.layer(range.end - 1).arena_bytes;
  const bool from_slab = slab.defined() && slab_end > slab_begin;
  if (from_slab) host.push_back(slab.narrow(0, slab_begin, slab_end - slab_begin));
  for (int64_t l = range.begin; l < range.end; ++l) {
    gated.push_back(l);
    if (!from_slab) continue;
    for (int64_t id : store.layer(l).owned) source[id] = {0, true};  // host[0]
  }
  for (int64_t l = range.begin; l < range.end; ++l) {
    for (int64_t id : store.layer(l).param_ids) {
      if (source.count(id)) continue;
      // Tied to a layer outside this stage: its master tensor alone.
      gated.push_back(store.params()[id].owner);
      source[id] = {host.size(), false};
      host.push_back(store.params()[id].master.detach());
    }
  }
  const size_t first_buffer = host.size();
  std::vector<FencePtr> buffers_downloaded;
  StageTensors st;
  for (int64_t l = range.begin; l < range.end; ++l) {
    const size_t layer_begin = host.size();
    if (!model.buffer_source || layers[l]->named_buffers().empty()) {
      for (const auto& [name, b] : layers[l]->named_buffers()) host.push_back(b);
    } else {
      // An earlier call still running left them: the values its forward
      // published, on the host once its download (of the buffers it wrote,
      // if any) completes. Blocks until it published them.
      BufferHandoff::Published earlier = model.buffer_source->wait(l);
      const NamedTensors masters = layers[l]->named_buffers();
      TORCH_INTERNAL_ASSERT(earlier.values.size() == masters.size());
      for (size_t i = 0; i < masters.size(); ++i) {
        // undefined: left as it was
        host.push_back(earlier.values[i].defined() ? earlier.values[i] : masters[i].second);
      }
      if (earlier.downloaded) buffers_downloaded.push_back(std::move(earlier.downloaded));
    }
    st.buffer_sources.emplace_back(host.begin() + layer_begin, host.end());
  }
  std::vector<at::Tensor> moved;
  if (!host.empty()) {
    for (const at::Tensor& t : host) {
      if (t.defined()) st.bytes += static_cast<int64_t>(t.nbytes());
    }
    auto gate = std::make_shared<ParamGateFence>(model.gate, std::move(gated), model.generation,
                                                 std::move(buffers_downloaded));
    // The lane waits for the gate, then copies: the worker goes on, and a
    // trace shows the wait apart from the copy.
    if (timed && !gate->query()) st.gate_start = dev.mark(Lane::kParamUpload);
    dev.lane_wait(Lane::kParamUpload, gate);
    if (timed) st.start = dev.mark(Lane::kParamUpload);
    moved = dev.upload(host, Lane::kParamUpload, nullptr);
    if (timed) st.end = dev.mark(Lane::kParamUpload);
    st.uploaded = dev.lane_fence(Lane::kParamUpload);
  } else if (timed) {
    st.start = dev.mark(Lane::kParamUpload);
    st.end = st.start;
  }
  size_t next_buffer = first_buffer;
  for (int64_t l = range.begin; l < range.end; ++l) {
    std::vector<at::Tensor> params;
    for (int64_t id : store.layer(l).param_ids) {
      const auto& [index, in_arena] = source.at(id);
      if (!in_arena) {
        params.push_back(moved[index]);
        continue;
      }
      const int64_t owner_offset = store.layer(store.params()[id].owner).slab_offset - slab_begin;
      params.push_back(store.view_on_device(moved[index], owner_offset, id));
    }
    std::vector<at::Tensor> buffers;
    for (size_t b = 0; b < layers[l]->named_buffers().size(); ++b) buffers.push_back(moved[next_buffer++]);
    st.params.push_back(std::move(params));
    st.buffers.push_back(std::move(buffers));
  }
  return st;
}

int64_t bytes_of(const c10::IValue& value) {
  int64_t bytes = 0;
  for (const at::Tensor& t : flatten_tensors(value)) {
    if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
  }
  return bytes;
}

}  // namespace roundpipe
