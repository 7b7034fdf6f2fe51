// The copies a job issues: a stage's parameters and buffers to its device,
// values between jobs (hand-offs), each with the fence after which it holds.
// Called on the device's worker thread; nothing here waits on the host.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <vector>

#include "engine/call.h"
#include "runtime/device.h"

namespace roundpipe {

// A value on a device and the fence compute waits for before reading it.
struct OnDevice {
  c10::IValue value;
  FencePtr fence;  // null: ready now
};

// `slot`'s value on `dev`: uploaded on the activation lane unless it is
// there already (then its producer's fence).
OnDevice to_device(Device& dev, const Slot& slot);

// `value` (on `dev`, made by the compute issued so far) handed to device
// `consumer` (-1: the host): downloaded, or left where it is when the
// consumer is `dev`.
Slot hand_off(Device& dev, const c10::IValue& value, int64_t consumer);

// Uploads the parameters and buffers of `layers` to `dev` in one batch,
// once the optimizer wrote them: the parameter-upload lane waits for that,
// not the worker (a CPU device's lane thread; an accelerator's issuing
// thread, since a stream cannot wait for the optimizer thread and a blocking
// host callback would stall every stream's callbacks), so compute already
// issued keeps the device busy. A stage without parameters or buffers
// uploads nothing, and its fence is null. With `timed`, the upload's start
// and end marks are taken (the end before the fence, so compute waiting for
// it starts after it), and the wait's start when the gate was closed.
StageTensors upload_stage(Device& dev, const ModelView& model, LayerRange layers, bool timed);

// Bytes of the tensors in `value`.
int64_t bytes_of(const c10::IValue& value);

}  // namespace roundpipe
