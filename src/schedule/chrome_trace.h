// Timeline traces: what ran where and when, written as a Chrome trace
// (JSON "Trace Event Format"; opens in Perfetto and chrome://tracing).
//
// Layout of a written trace: one process per device ("cpu:0", "cuda:1", ...)
// with one thread (row) per lane: "param upload", "act upload", "compute",
// "download"; and a process "host" with the row "optimizer". Every event is a
// complete event ("ph": "X", microseconds) whose "cat" is its kind and whose
// "args" hold model, call, job kind, stage, layers "[begin, end)",
// microbatch and bytes where they apply. The engine (real runs) and the
// simulator write the same layout.
//
// Thread-safety: TraceEvent is a value; write_chrome_trace is reentrant.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace roundpipe {

enum class TraceLane { kParamUpload, kActUpload, kCompute, kDownload, kOptimizer };

// "param upload", "act upload", "compute", "download", "optimizer".
const char* trace_lane_name(TraceLane lane);

struct TraceEvent {
  int64_t device = -1;  // pool index; -1: the host (optimizer lane)
  TraceLane lane = TraceLane::kCompute;
  // Kind of work, the event's category: "upload" (parameters), "compute",
  // "download" (gradients, buffers), "handoff" (activations between jobs or
  // to/from the host), "optimizer", "wait" (a parameter upload waiting for
  // the optimizer to write the stage's parameters).
  std::string kind;
  std::string name;     // shown on the bar, e.g. "fwd s2 mb0"
  double start_us = 0;  // from the trace's origin
  double dur_us = 0;
  // Arguments; -1 / empty: does not apply.
  std::string model;
  int64_t call = -1;
  std::string job;  // "forward", "fused", "backward"
  int64_t stage = -1;
  int64_t layer_begin = -1, layer_end = -1;
  int64_t microbatch = -1;
  int64_t bytes = -1;
};

// Writes `events` as a Chrome trace to `path`, atomically (a temporary file
// beside it, flushed and renamed over `path`). `device_names[i]` names device
// i (missing names become "device i"). Throws c10::Error when the file cannot
// be written (the previous file at `path`, if any, is then unchanged).
void write_chrome_trace(const std::string& path, const std::vector<TraceEvent>& events,
                        const std::vector<std::string>& device_names);

// `s` as a JSON string literal (quoted and escaped).
std::string json_quoted(const std::string& s);

// The JSON text write_chrome_trace writes.
std::string chrome_trace_json(const std::vector<TraceEvent>& events,
                              const std::vector<std::string>& device_names);

}  // namespace roundpipe
