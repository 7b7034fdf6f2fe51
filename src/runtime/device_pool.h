// The process-wide pool of devices and the round-robin hand-out of jobs.
//
// For tests of error handling the pool can make every device a
// FaultInjectingDevice (fault_injecting_device.h) around the device it
// would make otherwise.
//
// Thread-safety: thread-safe. The pool lives until process exit.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/device.h"

namespace roundpipe {

class FaultInjectingDevice;

class DevicePool {
 public:
  // The pool, created from ROUNDPIPE_DEVICES on first call.
  static DevicePool& instance();
  // For tests: the pool wraps each device it makes in a FaultInjectingDevice.
  // Call before the pool's first use (the C++ test binary's main does);
  // throws c10::Error once the pool exists.
  static void wrap_devices_for_fault_injection();

  // Parses a ROUNDPIPE_DEVICES value into device specs ("cpu:N" -> N CPU
  // devices). Throws c10::ValueError with the accepted forms.
  static std::vector<std::string> parse_spec(const std::string& spec, int64_t num_cuda_devices);

  int64_t size() const { return static_cast<int64_t>(devices_.size()); }
  Device& device(int64_t i) const { return *devices_.at(i); }
  // Device i as its fault-injecting wrapper; throws c10::Error unless the
  // pool wraps its devices (wrap_devices_for_fault_injection).
  FaultInjectingDevice& fault_injecting_device(int64_t i) const;

  // Submits task i to device devices[i], with no other batch interleaved, so
  // every device sees batches in the same order (a task may wait on earlier
  // tasks of its batch without deadlock). Which device runs which task is the
  // scheduler's decision (src/schedule/scheduler.h).
  void submit_batch(const std::vector<int64_t>& devices,
                    const std::vector<std::function<void(Device&)>>& tasks);

 private:
  DevicePool(const std::vector<std::string>& specs, bool wrap_for_fault_injection);

  std::vector<std::unique_ptr<Device>> devices_;
  std::mutex submit_mu_;
};

}  // namespace roundpipe
