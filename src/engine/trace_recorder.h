// The process-wide trace recorder behind roundpipe/trace.h: events from the
// engine's calls and optimizer steps, in host-clock time from the trace's start.
//
// Thread-safety: thread-safe.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "schedule/chrome_trace.h"

namespace roundpipe {

class Tracer {
 public:
  // The recorder; starts tracing to $ROUNDPIPE_TRACE on first use when set.
  static Tracer& instance();

  void start(const std::string& path);
  void stop();
  bool on() const;
  // host_now_ms() of the trace's start (events are relative to it).
  double origin_ms() const;
  // Adds events whose start_us are host-clock microseconds (host_now_ms() *
  // 1000); they are made relative to the trace's origin. Dropped when off.
  void add(std::vector<TraceEvent> events);
  // The events recorded since start() (relative to the origin).
  std::vector<TraceEvent> events() const;

  ~Tracer();  // writes a trace still being recorded (at process exit)

 private:
  Tracer();
  void write_locked();

  const std::vector<std::string> device_names_;
  mutable std::mutex mu_;
  bool on_ = false;                 // guarded by mu_
  std::string path_;                // guarded by mu_
  double origin_ms_ = 0;            // guarded by mu_
  std::vector<TraceEvent> events_;  // guarded by mu_
};

}  // namespace roundpipe
