// The process-wide pool of devices and the round-robin hand-out of jobs.
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

class DevicePool {
 public:
  // The pool, created from ROUNDPIPE_DEVICES on first call.
  static DevicePool& instance();

  // Parses a ROUNDPIPE_DEVICES value into device specs ("cpu:N" -> N CPU
  // devices). Throws c10::ValueError with the accepted forms.
  static std::vector<std::string> parse_spec(const std::string& spec, int64_t num_cuda_devices);

  int64_t size() const { return static_cast<int64_t>(devices_.size()); }
  Device& device(int64_t i) const { return *devices_.at(i); }

  // Submits task i to device devices[i], with no other batch interleaved, so
  // every device sees batches in the same order (a task may wait on earlier
  // tasks of its batch without deadlock). Which device runs which task is the
  // scheduler's decision (src/schedule/scheduler.h).
  void submit_batch(const std::vector<int64_t>& devices,
                    const std::vector<std::function<void(Device&)>>& tasks);

 private:
  explicit DevicePool(const std::vector<std::string>& specs);

  std::vector<std::unique_ptr<Device>> devices_;
  std::mutex submit_mu_;
};

}  // namespace roundpipe
