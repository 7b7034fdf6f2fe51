// One execution device of the pool: a worker thread plus the means to move
// tensors between the host and the device and to order work between lanes.
//
// Devices hold no model state: they execute, they do not decide. Two
// backends implement this interface:
//  - AcceleratorDevice: a CUDA (or other c10 accelerator) device, with four
//    streams (parameter upload, activation upload, compute, download) ordered
//    by c10::Event.
//  - CpuDevice: a virtual device for machines without accelerators. Copies
//    are real; everything its worker allocates is charged to its own memory
//    counter; lanes are synchronous, so fences are always complete.
//
// Thread-safety: submit(), memory queries and name() are thread-safe; every
// other method must be called on this device's worker thread (inside a task).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

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
};
using FencePtr = std::shared_ptr<const Fence>;

// A point in one lane's work, for timing (traces, per-layer times).
class TimeMark {
 public:
  explicit TimeMark(double host_ms) : host_ms_(host_ms) {}
  virtual ~TimeMark() = default;
  // Milliseconds from `earlier` (a mark of the same device) to this mark, as
  // the device saw it. Valid once the work before both marks has finished.
  virtual double ms_since(const TimeMark& earlier) const { return host_ms_ - earlier.host_ms_; }
  // Host steady clock (host_now_ms) when the mark was made.
  double host_ms() const { return host_ms_; }

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
  // before it. The task runs with the compute lane current.
  void submit(std::function<void()> task);

  // Bytes in use on the device now, and the most since the last reset.
  virtual int64_t memory_allocated() const = 0;
  virtual int64_t max_memory_allocated() const = 0;
  virtual void reset_peak_memory() = 0;

  // ---- worker thread only ----
  // Copies a host tensor to a new device tensor on `lane`, after `after`
  // (a fence from any device or the host, may be null). Later compute sees it.
  virtual at::Tensor upload(const at::Tensor& host, Lane lane, const FencePtr& after) = 0;
  // Copies a device tensor (produced by compute submitted so far) to new host
  // memory on the download lane. The host copy is valid once the returned
  // fence completes (`*fence_out`).
  virtual at::Tensor download(const at::Tensor& device_tensor, FencePtr* fence_out) = 0;
  // Makes the compute lane wait for `fence` (null: no-op), without blocking
  // the host.
  virtual void compute_wait(const FencePtr& fence) = 0;
  // A fence after all compute submitted so far.
  virtual FencePtr compute_fence() = 0;
  // Blocks until all work submitted by this worker has finished.
  virtual void synchronize() = 0;
  // A mark after the work submitted on `lane` so far. Also callable from the
  // autograd thread while this device's worker waits in a backward pass.
  virtual MarkPtr mark(Lane lane) = 0;
  // Called on the worker before each layer computation (forward or
  // recompute of one layer for one microbatch); fault injection hooks here.
  virtual void before_layer() {}

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
};

// Deliberate failures of a CPU virtual device, for tests of error handling:
// a parameter or value upload, a download, an allocation, or a layer
// computation (forward or recompute of one layer for one microbatch).
enum class Fault { kUpload, kDownload, kAllocation, kCompute };

// The CPU virtual device.
class CpuDevice final : public Device {
 public:
  explicit CpuDevice(int index);
  ~CpuDevice() override;

  // Makes the nth (>= 1) operation of kind `fault` on this device from now
  // fail once with a c10::Error saying "injected fault"; nth 0 disarms.
  // Allocations count every tensor the device's work allocates.
  void inject_fault(Fault fault, int64_t nth);
  // Memory the device may use, like an accelerator's (0: unlimited).
  // Allocations beyond it fail with "out of memory".
  void set_memory_capacity(int64_t bytes) { counter_.set_capacity(bytes); }
  // A slow device: every layer computation first sleeps this long (0: none).
  void set_layer_delay(std::chrono::microseconds delay) { layer_delay_us_.store(delay.count()); }

  c10::Device torch_device() const override { return c10::Device(c10::DeviceType::CPU); }
  int64_t memory_allocated() const override { return counter_.current(); }
  int64_t max_memory_allocated() const override { return counter_.peak(); }
  void reset_peak_memory() override { counter_.reset_peak(); }

  at::Tensor upload(const at::Tensor& host, Lane lane, const FencePtr& after) override;
  at::Tensor download(const at::Tensor& device_tensor, FencePtr* fence_out) override;
  void compute_wait(const FencePtr& fence) override {}
  FencePtr compute_fence() override { return nullptr; }
  void synchronize() override {}
  // Lanes are synchronous: a mark is the host clock now.
  MarkPtr mark(Lane lane) override { return std::make_shared<TimeMark>(host_now_ms()); }
  void before_layer() override;

 protected:
  void run_task(const std::function<void()>& task) override;

 private:
  void check_fault(Fault fault);

  MemoryCounter counter_;
  std::atomic<int64_t> fail_upload_in_{0};
  std::atomic<int64_t> fail_download_in_{0};
  std::atomic<int64_t> fail_compute_in_{0};
  std::atomic<int64_t> layer_delay_us_{0};
};

// Creates the accelerator device `index` of type `type` (e.g. CUDA), pool
// position `pool_index`. Throws when the backend is not available.
std::unique_ptr<Device> make_accelerator_device(int pool_index, c10::Device device);

}  // namespace roundpipe
