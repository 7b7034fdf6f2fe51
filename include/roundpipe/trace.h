// Timeline traces of real runs: every job's parameter uploads,
// compute per (stage, microbatch), activation hand-offs and downloads on each
// device, and every optimizer step, written as a Chrome trace JSON that opens
// in Perfetto (ui.perfetto.dev) or chrome://tracing. scripts/trace-svg
// renders one as an SVG timeline. docs/trace.md explains how to read it.
//
// Setting ROUNDPIPE_TRACE=<file> in the environment starts tracing when the
// first model is built; the trace is written when the process exits (or by
// stop_trace()).
//
// Thread-safety: thread-safe; tracing is process-wide.
#pragma once

#include <string>

namespace roundpipe {

// Starts recording into memory, to be written to `path` (the file is not
// touched until then). If a trace is already being recorded, it is written
// first. Throws c10::ValueError when `path` is empty.
void start_trace(const std::string& path);

// Writes what was recorded since start_trace (atomically: the file is
// replaced whole) and stops recording. A call's events are added when the
// call returns, an optimizer step's when it ends: stop after synchronize() to
// include everything. No-op when not tracing. Throws c10::Error when the file
// cannot be written (recording stops anyway).
void stop_trace();

// Whether a trace is being recorded.
bool tracing();

}  // namespace roundpipe
