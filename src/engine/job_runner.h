// What a device worker does for one job: executes the job's lane program
// (schedule/lane_program.h) on the device.
#pragma once

#include <cstddef>

#include "engine/call.h"
#include "runtime/device.h"

namespace roundpipe {

// Runs job `j` of `call` on `device` (a device worker task). Never throws:
// errors are recorded in the call. The worker never owns the call: its owner
// waits for every job (wait_all) and destroys it on its own thread, since
// the values it holds may be Python objects, which a worker must not need
// once the call returned (the interpreter may be shutting down).
void run_job(Call& call, size_t j, Device& device);

}  // namespace roundpipe
