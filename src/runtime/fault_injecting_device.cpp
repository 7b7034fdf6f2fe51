// A device that fails on purpose, for tests (fault_injecting_device.h).
#include "runtime/fault_injecting_device.h"

#include <c10/util/Exception.h>

#include <thread>
#include <utility>

namespace roundpipe {

FaultInjectingDevice::FaultInjectingDevice(std::unique_ptr<Device> device)
    : Device(device->index(), device->name()), device_(std::move(device)) {}

// Starts no worker of its own: its tasks run on the wrapped device's.
FaultInjectingDevice::~FaultInjectingDevice() = default;

void FaultInjectingDevice::submit(std::function<void()> task) { device_->submit(std::move(task)); }

void FaultInjectingDevice::inject_fault(Fault fault, int64_t nth) {
  TORCH_CHECK_VALUE(nth >= 0, "inject_fault: nth must be >= 1 (0 disarms), got ", nth);
  switch (fault) {
    case Fault::kUpload:
      fail_upload_in_.store(nth);
      break;
    case Fault::kDownload:
      fail_download_in_.store(nth);
      break;
    case Fault::kAllocation: {
      auto* cpu = dynamic_cast<CpuDevice*>(device_.get());
      TORCH_CHECK(cpu != nullptr, "inject_fault: allocation faults need a CPU device; ", name(),
                  " is not one");
      cpu->memory_counter().fail_allocation(nth);
      break;
    }
    case Fault::kCompute:
      fail_compute_in_.store(nth);
      break;
  }
}

void FaultInjectingDevice::check_fault(Fault fault) {
  std::atomic<int64_t>& in = fault == Fault::kUpload     ? fail_upload_in_
                             : fault == Fault::kDownload ? fail_download_in_
                                                         : fail_compute_in_;
  int64_t due = in.load();
  while (due > 0 && !in.compare_exchange_weak(due, due - 1)) {
  }
  TORCH_CHECK(due != 1, "injected fault: ",
              fault == Fault::kUpload     ? "upload"
              : fault == Fault::kDownload ? "download"
                                          : "layer computation",
              " failed on ", name());
}

std::vector<at::Tensor> FaultInjectingDevice::upload(const std::vector<at::Tensor>& host, Lane lane,
                                                     const FencePtr& after) {
  check_fault(Fault::kUpload);
  return device_->upload(host, lane, after);
}

std::vector<at::Tensor> FaultInjectingDevice::download(
    const std::vector<at::Tensor>& device_tensors) {
  check_fault(Fault::kDownload);
  return device_->download(device_tensors);
}

void FaultInjectingDevice::before_layer() {
  check_fault(Fault::kCompute);
  const int64_t delay = layer_delay_us_.load();
  if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
  device_->before_layer();
}

}  // namespace roundpipe
