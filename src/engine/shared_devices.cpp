// The devices every model shares (shared_devices.h).
#include "engine/shared_devices.h"

namespace roundpipe {

SharedDevices& SharedDevices::instance() {
  // Leaked on purpose, as the pool is: it must outlive every model,
  // including ones used or destroyed during static destruction. A
  // constructor that throws (the pool's) leaves it unmade, and the next
  // call tries again.
  static SharedDevices* devices = new SharedDevices(DevicePool::instance());
  return *devices;
}

SharedDevices::SharedDevices(DevicePool& pool) : pool_(pool), dispatcher_(pool.size()) {}

}  // namespace roundpipe
