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

  // Submits a batch of tasks to the first `num_devices` devices, task i to
  // device (first + i) % num_devices, with no other batch interleaved, so every
  // device sees batches in the same order (a task may wait on earlier tasks of
  // its batch without deadlock). `first` continues the round-robin from the
  // previous batch. Returns the device index of each task.
  std::vector<int64_t> assign_devices(int64_t num_tasks, int64_t num_devices);
  void submit_batch(const std::vector<int64_t>& devices,
                    const std::vector<std::function<void(Device&)>>& tasks);

 private:
  explicit DevicePool(const std::vector<std::string>& specs);

  std::vector<std::unique_ptr<Device>> devices_;
  std::mutex submit_mu_;
  int64_t next_ = 0;  // guarded by submit_mu_: round-robin position
};

}  // namespace roundpipe
