// A device that fails on purpose, for tests of error handling (DESIGN.md 1):
// it wraps a device of the pool and passes everything through to it, except
// that it can make an upload, a download, an allocation or a layer
// computation fail, and can make every layer computation late (a slow
// device).
//
// The production devices have no such hooks. The pool wraps its devices only
// when asked before it makes them (DevicePool::wrap_devices_for_fault_injection,
// which the C++ test binary's main calls), and hands the wrappers out with
// DevicePool::fault_injecting_device. Disarmed, a wrapper changes nothing:
// its tasks run on the wrapped device's worker, in the wrapped device's
// memory scope, and every lane operation is the wrapped device's.
//
// Thread-safety: as Device's (submit(), memory queries and name() from any
// thread, the rest on the worker); inject_fault and set_layer_delay are
// thread-safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "runtime/device.h"

namespace roundpipe {

// What a wrapper can make fail: a parameter or value upload, a download, an
// allocation (CPU devices: every tensor the device's work allocates counts),
// or a layer computation (forward or recompute of one layer for one
// microbatch).
enum class Fault { kUpload, kDownload, kAllocation, kCompute };

class FaultInjectingDevice final : public Device {
 public:
  // Wraps `device` (not null), with its pool index and name.
  explicit FaultInjectingDevice(std::unique_ptr<Device> device);
  ~FaultInjectingDevice() override;

  // The wrapped device.
  Device& wrapped() const { return *device_; }

  // Makes the nth (>= 1) operation of kind `fault` on this device from now
  // fail once with a c10::Error saying "injected fault"; nth 0 disarms.
  // Allocation faults need a CPU device (c10::Error otherwise).
  void inject_fault(Fault fault, int64_t nth);
  // A slow device: every layer computation first sleeps this long (0: none).
  void set_layer_delay(std::chrono::microseconds delay) { layer_delay_us_.store(delay.count()); }

  // Runs the task on the wrapped device's worker.
  void submit(std::function<void()> task) override;
  c10::Device torch_device() const override { return device_->torch_device(); }
  int64_t memory_allocated() const override { return device_->memory_allocated(); }
  int64_t max_memory_allocated() const override { return device_->max_memory_allocated(); }
  int64_t max_memory_reserved() const override { return device_->max_memory_reserved(); }
  void reset_peak_memory() override { device_->reset_peak_memory(); }

  std::vector<at::Tensor> upload(const std::vector<at::Tensor>& host, Lane lane,
                                 const FencePtr& after) override;
  std::vector<at::Tensor> download(const std::vector<at::Tensor>& device_tensors) override;
  void lane_wait(Lane lane, const FencePtr& fence) override { device_->lane_wait(lane, fence); }
  FencePtr lane_fence(Lane lane) override { return device_->lane_fence(lane); }
  void compute_wait(const FencePtr& fence) override { device_->compute_wait(fence); }
  void synchronize() override { device_->synchronize(); }
  MarkPtr mark(Lane lane) override { return device_->mark(lane); }
  void before_layer() override;

 private:
  // Throws the injected fault when the operation of kind `fault` is the one due.
  void check_fault(Fault fault);

  std::unique_ptr<Device> device_;
  std::atomic<int64_t> fail_upload_in_{0};
  std::atomic<int64_t> fail_download_in_{0};
  std::atomic<int64_t> fail_compute_in_{0};
  std::atomic<int64_t> layer_delay_us_{0};
};

}  // namespace roundpipe
