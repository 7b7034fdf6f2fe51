// Test helpers for CPU devices with delayed copies: while a CopyDelay lives,
// every copy on every CPU device completes `us` microseconds after it was
// issued, its floating-point destination reading as NaN until then. And the
// CPU devices' fault-injecting wrappers, which make a device slow
// (set_layer_delay).
#pragma once

#include <chrono>
#include <vector>

#include "runtime/device.h"
#include "runtime/device_pool.h"
#include "runtime/fault_injecting_device.h"

namespace roundpipe {
namespace testing {

// The pool's CPU devices (inside their fault-injecting wrappers).
inline std::vector<CpuDevice*> cpu_devices() {
  std::vector<CpuDevice*> out;
  DevicePool& pool = DevicePool::instance();
  for (int64_t i = 0; i < pool.size(); ++i) {
    Device* d = &pool.device(i);
    if (auto* wrapper = dynamic_cast<FaultInjectingDevice*>(d)) d = &wrapper->wrapped();
    if (auto* cpu = dynamic_cast<CpuDevice*>(d)) out.push_back(cpu);
  }
  return out;
}

// The pool's CPU devices as their fault-injecting wrappers (tests/cpp/main.cpp).
inline std::vector<FaultInjectingDevice*> slow_cpu_devices() {
  std::vector<FaultInjectingDevice*> out;
  DevicePool& pool = DevicePool::instance();
  for (int64_t i = 0; i < pool.size(); ++i) {
    FaultInjectingDevice& wrapper = pool.fault_injecting_device(i);
    if (dynamic_cast<CpuDevice*>(&wrapper.wrapped()) != nullptr) out.push_back(&wrapper);
  }
  return out;
}

class CopyDelay {
 public:
  explicit CopyDelay(int64_t us) {
    for (CpuDevice* d : cpu_devices()) {
      before_.push_back(d->copy_delay());
      d->set_copy_delay(std::chrono::microseconds(us));
    }
  }
  ~CopyDelay() {
    auto devices = cpu_devices();
    for (size_t i = 0; i < devices.size(); ++i) devices[i]->set_copy_delay(before_[i]);
  }
  CopyDelay(const CopyDelay&) = delete;
  CopyDelay& operator=(const CopyDelay&) = delete;

 private:
  std::vector<std::chrono::microseconds> before_;
};

}  // namespace testing
}  // namespace roundpipe
