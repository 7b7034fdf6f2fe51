// Test helpers for CPU devices with delayed copies: while a CopyDelay lives,
// every copy on every CPU device completes `us` microseconds after it was
// issued, its floating-point destination reading as NaN until then.
#pragma once

#include <chrono>
#include <vector>

#include "runtime/device.h"
#include "runtime/device_pool.h"

namespace roundpipe {
namespace testing {

inline std::vector<CpuDevice*> cpu_devices() {
  std::vector<CpuDevice*> out;
  DevicePool& pool = DevicePool::instance();
  for (int64_t i = 0; i < pool.size(); ++i) {
    if (auto* d = dynamic_cast<CpuDevice*>(&pool.device(i))) out.push_back(d);
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
