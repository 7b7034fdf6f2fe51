// Data parallelism across processes and machines (docs/distributed.md).
//
// Each process runs a RoundPipe model on its own devices with its share of the
// batch. Give the models one ProcessGroup (RoundPipeOptions::process_group):
// construction copies rank 0's parameters, buffers and seed to every process,
// and each step() combines the processes' gradients on the optimizer thread,
// layer by layer, before step_fn, so every process applies the same update.
//
//   auto group = roundpipe::ProcessGroup::create();  // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   roundpipe::RoundPipe model(seq, roundpipe::RoundPipeOptions().set_process_group(group));
//   ... model.forward_backward(my_share_of_the_batch, ...); model.step(...);
//
// With the default GradientReduction::kSum, processes that each split their
// share into M microbatches train exactly like one process running all
// W * M microbatches of the concatenated batch (gradients are sums over
// microbatches; dropout draws the same random streams, since process r's
// microbatch m is microbatch r * M + m of that run). Every process must use
// the same num_microbatch and issue the same sequence of steps. Buffers
// updated in forward (e.g. running statistics) stay per process: each
// follows its own microbatches (rank 0's are what a checkpoint holds).
// Average them yourself where that matters (all_reduce_sum after synchronize).
//
// Collectives must be issued in the same order on every process. A group
// serves one RoundPipe model (create one group per model); the model issues
// its collectives on its optimizer thread, and the blocking collectives below,
// called from any other thread, first wait for the model's queued steps, so
// that they come after the same steps everywhere (inside a step_fn they run
// in place, after that step's gradients were combined).
//
// Thread-safety: thread-safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace roundpipe {

class ProcessGroup;
namespace detail {
// RoundPipe marks the group it serves (one model per group).
// `drain` waits for the model's queued steps.
void attach_model(ProcessGroup& group, const std::string& model_name, std::function<void()> drain);
void detach_model(ProcessGroup& group);
}  // namespace detail

struct ProcessGroupOptions {
  // Where the processes meet:
  //  - "env://" (default): MASTER_ADDR and MASTER_PORT; rank 0 hosts the store
  //    (torchrun's convention);
  //  - "tcp://HOST:PORT": the same with an explicit address;
  //  - "file:///PATH": a file store on a filesystem all processes share; the
  //    file must not exist before the group is created (remove it after).
  std::string init_method = "env://";
  // This process's rank and the number of processes; -1 reads RANK and
  // WORLD_SIZE from the environment.
  int64_t rank = -1;
  int64_t world_size = -1;
  // How long meeting the peers and every collective may wait for a peer
  // before failing with an error (a peer that died or hangs).
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};

  ProcessGroupOptions& set_init_method(std::string v) { init_method = std::move(v); return *this; }
  ProcessGroupOptions& set_rank(int64_t v) { rank = v; return *this; }
  ProcessGroupOptions& set_world_size(int64_t v) { world_size = v; return *this; }
  ProcessGroupOptions& set_timeout(std::chrono::milliseconds v) { timeout = v; return *this; }
};

// How step() combines the processes' gradients.
enum class GradientReduction {
  kSum,   // sum over processes: equals one process running every microbatch
  kMean,  // sum divided by the number of processes
};

// Processes that run collectives on host tensors together: c10d's Gloo
// backend over TCP, or any c10d process group made elsewhere.
class ProcessGroup {
 public:
  // Meets the other processes (blocks until all arrived or the timeout).
  // Throws c10::ValueError for bad options or a missing environment
  // variable, c10::Error when the peers cannot be reached in time.
  static std::shared_ptr<ProcessGroup> create(ProcessGroupOptions options = {});
  // Uses a c10d process group made elsewhere: torch.distributed's (what
  // init_process_group returns, and DDP and FSDP take) or one made in C++.
  // Gloo groups reduce the host tensors in place; groups whose backend works
  // on CUDA tensors only (NCCL) get each tensor copied to the current CUDA
  // device and back. `timeout` is what the group's own collectives wait
  // (for messages). c10::ValueError for a null group.
  static std::shared_ptr<ProcessGroup> wrap(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                            std::chrono::milliseconds timeout = std::chrono::minutes(30));
  ~ProcessGroup();

  int64_t rank() const;
  int64_t world_size() const;
  std::chrono::milliseconds timeout() const;

  // A collective in flight; wait() blocks until it finished and throws a
  // c10::Error naming `what`, this rank and the failure (a peer that died
  // or did not answer within the timeout). After a failure the group is
  // broken (the processes no longer agree on the sequence of collectives):
  // every later collective throws at once; end the processes and restart
  // from a checkpoint.
  class Work {
   public:
    virtual ~Work() = default;
    virtual void wait() = 0;
  };
  // Starts summing `tensor` (contiguous, CPU) across the processes in
  // place. Every process must start the same collectives in the same order.
  // (The model's own collectives; does not wait for queued steps.)
  std::unique_ptr<Work> start_all_reduce_sum(at::Tensor tensor, std::string what);
  // Blocking collectives: sum in place, copy from `root` in place, barrier.
  // `what` names the collective in errors.
  void all_reduce_sum(at::Tensor tensor, const std::string& what);
  void broadcast(at::Tensor tensor, int64_t root, const std::string& what);
  void barrier(const std::string& what);

  class Impl;

 private:
  friend void detail::attach_model(ProcessGroup& group, const std::string& model_name, std::function<void()> drain);
  friend void detail::detach_model(ProcessGroup& group);
  explicit ProcessGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// True when this build of roundpipe has the c10d Gloo backend.
bool distributed_available();

}  // namespace roundpipe
