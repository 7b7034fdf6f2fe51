// One execution device of the pool: a worker thread plus lanes that move
// tensors between the host and the device, ordered by fences.
//
// Devices hold no model state: they execute, they do not decide. Two
// backends implement this interface:
//  - AcceleratorDevice: a CUDA (or other c10 accelerator) device; each lane
//    (parameter upload, activation upload, compute, download) is a stream,
//    fences are pooled c10 events.
//  - CpuDevice: a virtual device for machines without accelerators, which
//    behaves like a GPU: its copy lanes are threads that complete copies
//    later (ROUNDPIPE_CPU_COPY_DELAY_US), fences are completion events, and
//    everything its work allocates is charged to its own memory counter until
//    the fence of its last use completes. Its compute lane is the worker.
//
// Every copy is asynchronous on every backend: its result may be read only
// after a fence made on its lane after it (lane_fence), by compute through
// compute_wait, by the host through Fence::synchronize.
//
// Tests wrap devices in a FaultInjectingDevice (fault_injecting_device.h),
// which makes operations fail on purpose; the devices here have no test hooks.
//
// Thread-safety: submit(), memory queries and name() are thread-safe; every
// other method must be called on this device's worker thread (inside a task).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/memory_tracker.h"
#include "util/worker_thread.h"

namespace roundpipe {

enum class Lane { kParamUpload, kActUpload, kCompute, kDownload };

// Marks the work submitted on one lane up to a point. Complete-on-creation
// for synchronous backends.
class Fence {
 public:
  virtual ~Fence() = default;
  // Blocks the calling host thread until the marked work has finished.
  virtual void synchronize() const = 0;
  // True when the marked work has finished (never blocks; false when unsure).
  virtual bool query() const { return false; }
};
using FencePtr = std::shared_ptr<const Fence>;

// A point in one lane's work, for timing (traces, per-layer times).
class TimeMark {
 public:
  explicit TimeMark(double host_ms) : host_ms_(host_ms) {}
  virtual ~TimeMark() = default;
  // Milliseconds from `earlier` (a mark of the same device) to this mark, as
  // the device saw it. Valid once the work before both marks has finished.
  virtual double ms_since(const TimeMark& earlier) const { return host_ms() - earlier.host_ms(); }
  // Host steady clock (host_now_ms) when the lane reached the mark (a
  // device's own clock may only be related to it through ms_since).
  virtual double host_ms() const { return host_ms_; }

 private:
  double host_ms_;
};
using MarkPtr = std::shared_ptr<const TimeMark>;

// The host's steady clock in milliseconds.
double host_now_ms();

class Device {
 public:
  Device(int index, std::string name);
  virtual ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  int index() const { return index_; }            // position in the pool
  const std::string& name() const { return name_; }  // "cpu:1", "cuda:0"
  virtual c10::Device torch_device() const = 0;  // where its tensors live

  // Runs `task` on this device's worker thread, after every task submitted
  // before it. The task runs with the compute lane current. (A wrapper
  // runs it on the wrapped device's worker.)
  virtual void submit(std::function<void()> task);

  // Bytes in use on the device now, and the most since the last reset.
  virtual int64_t memory_allocated() const = 0;
  virtual int64_t max_memory_allocated() const = 0;
  // The most held from the device since the last reset, cached included.
  virtual int64_t max_memory_reserved() const { return max_memory_allocated(); }
  virtual void reset_peak_memory() = 0;

  // ---- worker thread only ----
  // Copies host tensors to new device tensors on `lane`, once `after` (a
  // fence from any device or the host; may be null) has completed. The
  // copies are complete at the next lane_fence(lane). Undefined tensors stay
  // undefined; the copies have no autograd history.
  virtual std::vector<at::Tensor> upload(const std::vector<at::Tensor>& host, Lane lane,
                                         const FencePtr& after) = 0;
  // Copies device tensors to new host memory on the download lane, after the
  // compute submitted so far: small tensors share host buffers, each copy
  // a contiguous tensor of its own (see download_batch.h). The copies
  // are complete at the next lane_fence(Lane::kDownload). Undefined tensors
  // stay undefined; the copies have no autograd history.
  virtual std::vector<at::Tensor> download(const std::vector<at::Tensor>& device_tensors) = 0;
  // Work submitted on copy lane `lane` from now on starts once `fence` (any
  // device's or the host's; null: no-op) has completed. The worker does not
  // block: a CPU device's lane thread waits, an accelerator's stream waits
  // for an event, and a host condition (the optimizer's parameter gate) is
  // waited for by the thread that issues the accelerator's parameter
  // uploads, so compute keeps being queued meanwhile.
  virtual void lane_wait(Lane lane, const FencePtr& fence) = 0;
  // A fence after all work submitted on `lane` so far.
  virtual FencePtr lane_fence(Lane lane) = 0;
  // Makes the compute lane wait for `fence` (null: no-op); an accelerator's
  // host thread does not block.
  virtual void compute_wait(const FencePtr& fence) = 0;
  // Blocks until all work submitted by this worker has finished.
  virtual void synchronize() = 0;
  // A mark after the work submitted on `lane` so far. Also callable from the
  // autograd thread while this device's worker waits in a backward pass.
  virtual MarkPtr mark(Lane lane) = 0;
  // Called on the worker before each layer computation (forward or
  // recompute of one layer for one microbatch); a FaultInjectingDevice
  // hooks here.
  virtual void before_layer() {}

  // Fences after everything submitted on every lane so far.
  std::vector<FencePtr> all_lane_fences();

  // ---- stage slots (worker thread only) ----
  // A device holds the tensors of at most kStageSlots jobs (the running stage
  // and the prefetched one). A job takes a slot before it uploads its stage
  // and gives it back when it is done, with the fences of its last work; a
  // slot is reused only once those fences completed (waited for on the host
  // here), so however far the worker runs ahead of its lanes, device memory
  // stays within kStageSlots stages plus one job's activations.
  static constexpr int kStageSlots = 2;
  void take_stage_slot();
  void give_back_stage_slot(std::vector<FencePtr> last_use);

 protected:
  // Set-up run on the worker thread before any task (thread-locals).
  virtual void on_worker_start() {}
  // Wraps every task (e.g. to make the compute stream current).
  virtual void run_task(const std::function<void()>& task) { task(); }
  // Subclasses call this at the end of their constructor.
  void start_worker();
  // Joins the worker; subclasses call this first in their destructor.
  void stop_worker();

 private:
  int index_;
  std::string name_;
  std::unique_ptr<WorkerThread> worker_;
  // Worker thread only.
  int slots_in_use_ = 0;
  std::deque<std::vector<FencePtr>> slots_released_;  // oldest first: their last use's fences
};

class CopyLane;

// The CPU virtual device.
class CpuDevice final : public Device {
 public:
  // `copy_delay`: every copy completes at least this long after it was
  // issued, and a floating-point destination reads as NaN until it has.
  CpuDevice(int index, std::chrono::microseconds copy_delay);
  ~CpuDevice() override;

  // Memory the device may use, like an accelerator's (0: unlimited).
  // Allocations beyond it fail with "out of memory".
  void set_memory_capacity(int64_t bytes) { counter_.set_capacity(bytes); }
  // Every copy issued from now on completes at least this long after it was
  // issued (ROUNDPIPE_CPU_COPY_DELAY_US sets it for every CPU device).
  void set_copy_delay(std::chrono::microseconds delay);
  std::chrono::microseconds copy_delay() const { return std::chrono::microseconds(copy_delay_us_.load()); }
  // The counter every allocation of the device's work is charged to.
  MemoryCounter& memory_counter() { return counter_; }

  c10::Device torch_device() const override { return c10::Device(c10::DeviceType::CPU); }
  int64_t memory_allocated() const override { return counter_.current(); }
  int64_t max_memory_allocated() const override { return counter_.peak(); }
  void reset_peak_memory() override { counter_.reset_peak(); }

  std::vector<at::Tensor> upload(const std::vector<at::Tensor>& host, Lane lane, const FencePtr& after) override;
  std::vector<at::Tensor> download(const std::vector<at::Tensor>& device_tensors) override;
  void lane_wait(Lane lane, const FencePtr& fence) override;
  FencePtr lane_fence(Lane lane) override;
  // Compute runs on the worker: waiting is blocking it.
  void compute_wait(const FencePtr& fence) override {
    if (fence) fence->synchronize();
  }
  void synchronize() override;
  MarkPtr mark(Lane lane) override;

 protected:
  void run_task(const std::function<void()>& task) override;

 private:
  CopyLane& copy_lane(Lane lane);
  // Makes a copy's destination read as NaN until the copy writes it, when
  // copies are delayed (a read without its fence then shows): part of the
  // delayed copies SPEC 3 describes, not a test hook.
  void poison(const at::Tensor& destination) const;

  MemoryCounter counter_;
  std::atomic<int64_t> copy_delay_us_;
  std::unique_ptr<CopyLane> lanes_[3];  // parameter upload, activation upload, download
};

// ROUNDPIPE_CPU_COPY_DELAY_US (0 when unset). Throws c10::ValueError on a
// value that is not a number of microseconds in 0..10^7.
std::chrono::microseconds cpu_copy_delay_from_env();

// Creates the accelerator device `index` of type `type` (e.g. CUDA), pool
// position `pool_index`. Throws when the backend is not available.
std::unique_ptr<Device> make_accelerator_device(int pool_index, c10::Device device);

}  // namespace roundpipe
