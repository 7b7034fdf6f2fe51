// Gradient combination and state broadcast for data parallelism.
#include "engine/data_parallel.h"

#include <ATen/ATen.h>

#include <deque>

namespace roundpipe {

GroupAttachment::GroupAttachment(std::shared_ptr<ProcessGroup> group, const std::string& model_name,
                                 std::function<void()> drain)
    : group_(std::move(group)) {
  detail::attach_model(*group_, model_name, std::move(drain));
}

GroupAttachment::~GroupAttachment() { detail::detach_model(*group_); }

void broadcast_model_state(ProcessGroup& group, HostStore& store,
                           const std::vector<std::shared_ptr<LayerHandle>>& layers,
                           uint64_t& seed) {
  at::NoGradGuard no_grad;
  at::Tensor seed_tensor = at::empty({1}, at::kLong);
  seed_tensor.fill_(static_cast<int64_t>(seed));
  group.broadcast(seed_tensor, 0, "broadcast of the seed");
  seed = static_cast<uint64_t>(seed_tensor.item<int64_t>());
  // Arenas hold every parameter of a layer: one collective each; parameters
  // left in place (PinMode) go one by one.
  for (int64_t l = 0; l < store.num_layers(); ++l) {
    const at::Tensor& arena = store.layer(l).arena;
    if (arena.defined()) {
      if (arena.numel() > 0) group.broadcast(arena, 0, "broadcast of layer " + std::to_string(l) + "'s parameters");
      continue;
    }
    for (int64_t id : store.layer(l).owned) {
      const HostParam& p = store.params()[id];
      at::Tensor m = p.master.detach();
      at::Tensor staged = m.is_contiguous() ? m : m.contiguous();
      group.broadcast(staged, 0, "broadcast of parameter '" + p.name + "'");
      if (!staged.is_same(m)) m.copy_(staged);
    }
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    for (auto& [name, buffer] : layers[l]->named_buffers()) {
      at::Tensor b = buffer.detach();
      at::Tensor staged = b.is_contiguous() ? b : b.contiguous();
      group.broadcast(staged, 0, "broadcast of buffer '" + std::to_string(l) + "." + name + "'");
      if (!staged.is_same(b)) b.copy_(staged);
    }
  }
}

namespace {

// One layer's gradients and has-gradient flags in one fp32 buffer:
// [grad of ids[0] | grad of ids[1] | ... | flag per id].
struct Bucket {
  std::vector<int64_t> ids;
  at::Tensor flat;
  std::unique_ptr<ProcessGroup::Work> work;
};

Bucket pack(const HostStore& store, int64_t layer, const std::vector<at::Tensor>& grads) {
  Bucket b;
  int64_t numel = 0;
  for (int64_t id : store.layer(layer).owned) {
    if (!store.params()[id].optim.defined()) continue;
    b.ids.push_back(id);
    numel += store.params()[id].master.numel();
  }
  if (b.ids.empty()) return b;
  b.flat = at::empty({numel + static_cast<int64_t>(b.ids.size())}, at::kFloat);
  int64_t offset = 0;
  for (size_t i = 0; i < b.ids.size(); ++i) {
    const int64_t n = store.params()[b.ids[i]].master.numel();
    const at::Tensor& g = grads[b.ids[i]];
    at::Tensor slice = b.flat.narrow(0, offset, n);
    if (g.defined()) {
      slice.copy_(g.reshape({-1}));
    } else {
      slice.zero_();
    }
    b.flat[numel + static_cast<int64_t>(i)].fill_(g.defined() ? 1.0 : 0.0);
    offset += n;
  }
  return b;
}

void unpack(const HostStore& store, Bucket& b, GradientReduction reduction, int64_t world_size,
            std::vector<at::Tensor>& grads) {
  const int64_t flags_at = b.flat.numel() - static_cast<int64_t>(b.ids.size());
  const float* flags = b.flat.data_ptr<float>() + flags_at;
  if (reduction == GradientReduction::kMean) b.flat.narrow(0, 0, flags_at).div_(static_cast<double>(world_size));
  int64_t offset = 0;
  for (size_t i = 0; i < b.ids.size(); ++i) {
    const at::Tensor& master = store.params()[b.ids[i]].master;
    const int64_t n = master.numel();
    grads[b.ids[i]] = flags[i] > 0 ? b.flat.narrow(0, offset, n).view(master.sizes()) : at::Tensor();
    offset += n;
  }
}

}  // namespace

void reduce_gradients(ProcessGroup& group, GradientReduction reduction, const HostStore& store,
                      std::vector<at::Tensor>& grads, const std::function<void(int64_t id)>& hand_off,
                      const std::string& what) {
  at::NoGradGuard no_grad;
  std::deque<Bucket> in_flight;
  auto finish_oldest = [&] {
    Bucket& b = in_flight.front();
    b.work->wait();
    unpack(store, b, reduction, group.world_size(), grads);
    for (int64_t id : b.ids) hand_off(id);
    in_flight.pop_front();
  };
  for (int64_t l = store.num_layers() - 1; l >= 0; --l) {
    Bucket b = pack(store, l, grads);
    if (b.ids.empty()) continue;
    b.work = group.start_all_reduce_sum(b.flat, what + "gradient all-reduce of layer " + std::to_string(l));
    in_flight.push_back(std::move(b));
    if (in_flight.size() > 1) finish_oldest();  // one layer in flight while the previous is handed off
  }
  while (!in_flight.empty()) finish_oldest();
}

}  // namespace roundpipe
