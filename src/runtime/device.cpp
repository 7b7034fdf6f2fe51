#include "runtime/device.h"

#include <ATen/ATen.h>

#include <chrono>
#include <limits>
#include <string>
#include <utility>

#include "runtime/copy_lane.h"
#include "runtime/download_batch.h"

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

std::vector<FencePtr> Device::all_lane_fences() {
  return {lane_fence(Lane::kParamUpload), lane_fence(Lane::kActUpload), lane_fence(Lane::kCompute),
          lane_fence(Lane::kDownload)};
}

void Device::take_stage_slot() {
  ++slots_in_use_;
  while (!slots_released_.empty() &&
         slots_in_use_ + static_cast<int>(slots_released_.size()) > kStageSlots) {
    for (const FencePtr& fence : slots_released_.front()) {
      if (fence) fence->synchronize();
    }
    slots_released_.pop_front();
  }
}

void Device::give_back_stage_slot(std::vector<FencePtr> last_use) {
  TORCH_INTERNAL_ASSERT(slots_in_use_ > 0, "a stage slot was given back twice on ", name_);
  --slots_in_use_;
  slots_released_.push_back(std::move(last_use));
}

CpuDevice::CpuDevice(int index, std::chrono::microseconds copy_delay)
    : Device(index, "cpu:" + std::to_string(index)), copy_delay_us_(copy_delay.count()) {
  counter_.name = name();
  install_tracking_cpu_allocator();
  static const char* const kLaneName[] = {"parameter upload", "activation upload", "download"};
  for (int i = 0; i < 3; ++i) {
    lanes_[i] = std::make_unique<CopyLane>("the " + std::string(kLaneName[i]) + " lane of " + name(), copy_delay);
  }
  start_worker();
}

CpuDevice::~CpuDevice() {
  stop_worker();
  for (auto& lane : lanes_) lane.reset();
}

CopyLane& CpuDevice::copy_lane(Lane lane) {
  switch (lane) {
    case Lane::kParamUpload: return *lanes_[0];
    case Lane::kActUpload: return *lanes_[1];
    case Lane::kDownload: return *lanes_[2];
    case Lane::kCompute: break;
  }
  TORCH_INTERNAL_ASSERT(false, "the compute lane of ", name(), " is its worker, not a copy lane");
}

void CpuDevice::set_copy_delay(std::chrono::microseconds delay) {
  TORCH_CHECK_VALUE(delay.count() >= 0, "set_copy_delay: the delay must be >= 0 us, got ", delay.count());
  copy_delay_us_.store(delay.count());
  for (auto& lane : lanes_) lane->set_delay(delay);
}

void CpuDevice::lane_wait(Lane lane, const FencePtr& fence) {
  if (!fence) return;
  if (lane == Lane::kCompute) return compute_wait(fence);
  copy_lane(lane).issue_after(fence, [] {});
}

FencePtr CpuDevice::lane_fence(Lane lane) {
  if (lane == Lane::kCompute) return nullptr;  // compute has run when the worker gets here
  return copy_lane(lane).fence();
}

void CpuDevice::synchronize() {
  for (auto& lane : lanes_) lane->synchronize();
}

MarkPtr CpuDevice::mark(Lane lane) {
  if (lane == Lane::kCompute) return std::make_shared<TimeMark>(host_now_ms());
  return copy_lane(lane).mark();
}

void CpuDevice::poison(const at::Tensor& destination) const {
  if (copy_delay_us_.load() > 0 && at::isFloatingType(destination.scalar_type())) {
    destination.fill_(std::numeric_limits<double>::quiet_NaN());
  }
}

void CpuDevice::run_task(const std::function<void()>& task) {
  // Everything the task allocates is this device's memory, except what is
  // explicitly downloaded (see download()).
  MemoryCounterScope scope(&counter_);
  task();
}

std::vector<at::Tensor> CpuDevice::upload(const std::vector<at::Tensor>& host, Lane lane,
                                          const FencePtr& after) {
  std::vector<at::Tensor> out(host.size()), sources(host.size());
  {
    MemoryCounterScope scope(&counter_);  // device memory from now until its last use
    for (size_t i = 0; i < host.size(); ++i) {
      if (!host[i].defined()) continue;
      out[i] = at::empty(host[i].sizes(), host[i].options().memory_format(at::MemoryFormat::Contiguous));
      poison(out[i]);
      sources[i] = host[i].detach();  // its own handle: the caller may set_data on its tensor
    }
  }
  copy_lane(lane).issue_after(after, [out, sources] {
    for (size_t i = 0; i < sources.size(); ++i) {
      if (sources[i].defined()) out[i].copy_(sources[i]);
    }
  });
  return out;
}

std::vector<at::Tensor> CpuDevice::download(const std::vector<at::Tensor>& device_tensors) {
  std::vector<at::Tensor> host, sources(device_tensors.size());
  {
    MemoryCounterScope host_memory(nullptr);
    // Host memory laid out as on an accelerator; a CPU copy has no fixed
    // cost to save, so every tensor is copied alone.
    host = plan_download(device_tensors, /*host_bytes=*/nullptr).host;
    for (size_t i = 0; i < host.size(); ++i) {
      if (!device_tensors[i].defined()) continue;
      poison(host[i]);
      // Its own handle to the storage: the worker releases a replica's
      // tensors with set_data once its job is done, maybe before the copy ran.
      sources[i] = device_tensors[i].detach();
    }
  }
  // Compute is synchronous: the sources are complete now. The copy holds
  // them, so their device memory lasts until the copy has run.
  copy_lane(Lane::kDownload).issue([host, sources] {
    for (size_t i = 0; i < host.size(); ++i) {
      if (sources[i].defined()) host[i].copy_(sources[i]);
    }
  });
  return host;
}

}  // namespace roundpipe
