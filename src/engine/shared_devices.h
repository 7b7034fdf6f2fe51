// The devices every model of the process shares, as the engine uses them:
// the device pool (runtime/device_pool.h), whose workers run the jobs, and
// the one Dispatcher (schedule/scheduler.h) that gives every model's jobs
// their devices, so that the calls of all models share one ledger of the
// devices' predicted free times (and, without times, one rotation).
//
// Made with the pool on first use (when making it throws, the next use
// tries again); never destroyed, like the pool, whose device threads outlive
// every model.
//
// Thread-safety: thread-safe. The user threads of any number of models use
// it at the same time: the dispatcher's ledger is under the dispatcher's
// mutex, the pool's submissions under the pool's. A call's jobs are
// assigned, then submitted; another model's call may be assigned or
// submitted in between, which changes only the predictions (a device runs
// its jobs in the order they were submitted).
#pragma once

#include "runtime/device_pool.h"
#include "schedule/scheduler.h"

namespace roundpipe {

class SharedDevices {
 public:
  // The process's, made with the pool (from ROUNDPIPE_DEVICES) on first use.
  static SharedDevices& instance();

  SharedDevices(const SharedDevices&) = delete;
  SharedDevices& operator=(const SharedDevices&) = delete;

  DevicePool& pool() const { return pool_; }
  Dispatcher& dispatcher() { return dispatcher_; }

 private:
  explicit SharedDevices(DevicePool& pool);

  DevicePool& pool_;
  Dispatcher dispatcher_;  // over every device of the pool
};

}  // namespace roundpipe
