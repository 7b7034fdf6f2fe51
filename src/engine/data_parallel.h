// Data parallelism inside a model (include/roundpipe/distributed.h): rank 0's
// state copied to every process at construction, the processes' gradients
// combined on the optimizer thread before step_fn.
//
// Thread-safety: call broadcast_model_state on the user thread before any
// call, reduce_gradients on the optimizer thread; each is a sequence of
// collectives every process must run in the same order.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/host_store.h"
#include "engine/layer_handle.h"
#include "roundpipe/distributed.h"

namespace roundpipe {

// Marks `group` as serving one model for the attachment's lifetime; `drain`
// waits for the model's queued steps (before users' collectives).
class GroupAttachment {
 public:
  GroupAttachment(std::shared_ptr<ProcessGroup> group, const std::string& model_name, std::function<void()> drain);
  ~GroupAttachment();
  GroupAttachment(const GroupAttachment&) = delete;
  GroupAttachment& operator=(const GroupAttachment&) = delete;

 private:
  std::shared_ptr<ProcessGroup> group_;
};

// Copies rank 0's parameters, buffers and random-stream seed to this process.
void broadcast_model_state(ProcessGroup& group, HostStore& store,
                           const std::vector<std::shared_ptr<LayerHandle>>& layers, uint64_t& seed);

// Combines `grads` (indexed by parameter id: this process's fp32 gradient of
// each parameter with an optimizer copy, undefined where it has none) across
// the processes, one collective per layer, last layer first, the next
// layer's in flight while a finished one is handed off: hand_off(id) is called
// with grads[id] set to the combined gradient (undefined when no process had
// one). `what` prefixes collective names in errors.
void reduce_gradients(ProcessGroup& group, GradientReduction reduction, const HostStore& store,
                      std::vector<at::Tensor>& grads, const std::function<void(int64_t id)>& hand_off,
                      const std::string& what);

}  // namespace roundpipe
