// What a finished call's jobs recorded (call.h JobRecord), turned into the
// model's per-layer times and into timeline trace events.
#pragma once

#include <vector>

#include "engine/call.h"
#include "roundpipe/timer.h"
#include "schedule/chrome_trace.h"

namespace roundpipe {

// Adds one record per (layer, action) that ran in `call` to `timer`: the
// time per microbatch (summed within a microbatch, e.g. the two
// recomputations of layer-grain recompute) averaged over microbatches. Call
// after every job has finished.
void record_layer_times(const Call& call, ModelTimer& timer);

// The call's spans as trace events, start_us in host-clock microseconds
// (host_now_ms() * 1000). Call after every job has finished.
std::vector<TraceEvent> call_trace_events(const Call& call);

}  // namespace roundpipe
