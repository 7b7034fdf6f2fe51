#include "engine/trace_recorder.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>

#include "roundpipe/devices.h"
#include "roundpipe/trace.h"
#include "runtime/device.h"

namespace roundpipe {

Tracer& Tracer::instance() {
  static Tracer tracer;
  return tracer;
}

// The device pool is built first, so that it outlives the tracer, whose
// destructor writes the trace at exit.
Tracer::Tracer() : device_names_(get_device_names()) {
  const char* path = std::getenv("ROUNDPIPE_TRACE");
  if (path != nullptr && *path != '\0') start(path);
}

Tracer::~Tracer() {
  try {
    stop();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "roundpipe: %s\n", e.what());
  }
}

void Tracer::start(const std::string& path) {
  TORCH_CHECK_VALUE(!path.empty(), "start_trace: the path is empty");
  stop();
  std::lock_guard<std::mutex> lock(mu_);
  on_ = true;
  path_ = path;
  origin_ms_ = host_now_ms();
  events_.clear();
}

void Tracer::stop() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!on_) return;
  on_ = false;
  std::vector<TraceEvent> events = std::move(events_);
  events_.clear();
  write_chrome_trace(path_, events, device_names_);
}

bool Tracer::on() const {
  std::lock_guard<std::mutex> lock(mu_);
  return on_;
}

double Tracer::origin_ms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return origin_ms_;
}

void Tracer::add(std::vector<TraceEvent> events) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!on_) return;
  for (TraceEvent& e : events) {
    e.start_us -= origin_ms_ * 1000.0;
    events_.push_back(std::move(e));
  }
}

std::vector<TraceEvent> Tracer::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

void start_trace(const std::string& path) { Tracer::instance().start(path); }
void stop_trace() { Tracer::instance().stop(); }
bool tracing() { return Tracer::instance().on(); }

}  // namespace roundpipe
