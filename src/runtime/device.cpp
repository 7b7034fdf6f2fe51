#include "runtime/device.h"

#include <thread>

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
  counter_.name = name();
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

void CpuDevice::inject_fault(Fault fault, int64_t nth) {
  TORCH_CHECK_VALUE(nth >= 0, "inject_fault: nth must be >= 1 (0 disarms), got ", nth);
  switch (fault) {
    case Fault::kUpload: fail_upload_in_.store(nth); break;
    case Fault::kDownload: fail_download_in_.store(nth); break;
    case Fault::kAllocation: counter_.fail_allocation(nth); break;
    case Fault::kCompute: fail_compute_in_.store(nth); break;
  }
}

void CpuDevice::check_fault(Fault fault) {
  std::atomic<int64_t>& in = fault == Fault::kUpload     ? fail_upload_in_
                             : fault == Fault::kDownload ? fail_download_in_
                                                         : fail_compute_in_;
  int64_t due = in.load();
  while (due > 0 && !in.compare_exchange_weak(due, due - 1)) {
  }
  TORCH_CHECK(due != 1, "injected fault: ",
              fault == Fault::kUpload ? "upload" : fault == Fault::kDownload ? "download" : "layer computation",
              " failed on ", name());
}

void CpuDevice::before_layer() {
  check_fault(Fault::kCompute);
  const int64_t delay = layer_delay_us_.load();
  if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
}

at::Tensor CpuDevice::upload(const at::Tensor& host, Lane lane, const FencePtr& after) {
  check_fault(Fault::kUpload);
  if (after) after->synchronize();
  MemoryCounterScope scope(&counter_);
  return host.clone(at::MemoryFormat::Contiguous);
}

at::Tensor CpuDevice::download(const at::Tensor& device_tensor, FencePtr* fence_out) {
  check_fault(Fault::kDownload);
  MemoryCounterScope host_memory(nullptr);
  if (fence_out) *fence_out = nullptr;
  return device_tensor.clone(at::MemoryFormat::Contiguous);
}

}  // namespace roundpipe
