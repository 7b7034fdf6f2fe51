#include "runtime/device.h"

#include <ATen/ATen.h>

#include <chrono>
#include <utility>

namespace roundpipe {

double host_now_ms() {
  using Ms = std::chrono::duration<double, std::milli>;
  return std::chrono::duration_cast<Ms>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Device::Device(int index, std::string name) : index_(index), name_(std::move(name)) {}

Device::~Device() = default;

void Device::start_worker() {
  worker_ = std::make_unique<WorkerThread>([this] { on_worker_start(); });
}

void Device::stop_worker() { worker_.reset(); }

void Device::submit(std::function<void()> task) {
  worker_->post([this, task = std::move(task)] { run_task(task); });
}

CpuDevice::CpuDevice(int index) : Device(index, "cpu:" + std::to_string(index)) {
  install_tracking_cpu_allocator();
  start_worker();
}

CpuDevice::~CpuDevice() { stop_worker(); }

void CpuDevice::run_task(const std::function<void()>& task) {
  // Everything the task allocates is this device's memory, except what is
  // explicitly downloaded (see download()).
  MemoryCounterScope scope(&counter_);
  task();
}

at::Tensor CpuDevice::upload(const at::Tensor& host, Lane lane, const FencePtr& after) {
  if (after) after->synchronize();
  MemoryCounterScope scope(&counter_);
  return host.clone(at::MemoryFormat::Contiguous);
}

at::Tensor CpuDevice::download(const at::Tensor& device_tensor, FencePtr* fence_out) {
  MemoryCounterScope host_memory(nullptr);
  if (fence_out) *fence_out = nullptr;
  return device_tensor.clone(at::MemoryFormat::Contiguous);
}

}  // namespace roundpipe
