#include "schedule/chrome_trace.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include "util/atomic_file.h"

namespace roundpipe {

const char* trace_lane_name(TraceLane lane) {
  switch (lane) {
    case TraceLane::kParamUpload:
      return "param upload";
    case TraceLane::kActUpload:
      return "act upload";
    case TraceLane::kCompute:
      return "compute";
    case TraceLane::kDownload:
      return "download";
    case TraceLane::kOptimizer:
      return "optimizer";
  }
  return "?";
}

std::string json_quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

namespace {

std::string quoted(const std::string& s) { return json_quoted(s); }

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", v);
  return buf;
}

// Chrome trace ids: the host is process 0, device i is process i + 1; a
// lane's thread id is its enum value.
int64_t pid_of(int64_t device) { return device + 1; }
int64_t tid_of(TraceLane lane) { return static_cast<int64_t>(lane); }

std::string device_name(const std::vector<std::string>& names, int64_t device) {
  if (device < 0) return "host";
  if (device < static_cast<int64_t>(names.size())) return names[device];
  return "device " + std::to_string(device);
}

}  // namespace

std::string chrome_trace_json(const std::vector<TraceEvent>& events,
                              const std::vector<std::string>& device_names) {
  std::ostringstream os;
  os << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  auto sep = [&] {
    if (!first) os << ",\n";
    first = false;
  };
  // Name every row that has events (and every device's rows, so idle
  // devices show up too), in a stable order.
  std::set<std::pair<int64_t, TraceLane>> rows;
  for (size_t d = 0; d < device_names.size(); ++d) {
    for (TraceLane lane : {TraceLane::kParamUpload, TraceLane::kActUpload, TraceLane::kCompute,
                           TraceLane::kDownload}) {
      rows.emplace(static_cast<int64_t>(d), lane);
    }
  }
  for (const TraceEvent& e : events) rows.emplace(e.device, e.lane);
  std::set<int64_t> processes;
  for (const auto& [device, lane] : rows) {
    if (processes.insert(device).second) {
      sep();
      os << "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << pid_of(device)
         << ",\"args\":{\"name\":" << quoted(device_name(device_names, device)) << "}}";
      sep();
      os << "{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":" << pid_of(device)
         << ",\"args\":{\"sort_index\":" << pid_of(device) << "}}";
    }
    sep();
    os << "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" << pid_of(device)
       << ",\"tid\":" << tid_of(lane) << ",\"args\":{\"name\":" << quoted(trace_lane_name(lane))
       << "}}";
    sep();
    os << "{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":" << pid_of(device)
       << ",\"tid\":" << tid_of(lane) << ",\"args\":{\"sort_index\":" << tid_of(lane) << "}}";
  }
  for (const TraceEvent& e : events) {
    sep();
    os << "{\"ph\":\"X\",\"name\":" << quoted(e.name) << ",\"cat\":" << quoted(e.kind)
       << ",\"pid\":" << pid_of(e.device) << ",\"tid\":" << tid_of(e.lane)
       << ",\"ts\":" << number(e.start_us) << ",\"dur\":" << number(e.dur_us) << ",\"args\":{";
    bool first_arg = true;
    auto arg = [&](const char* key, const std::string& json) {
      if (!first_arg) os << ",";
      first_arg = false;
      os << "\"" << key << "\":" << json;
    };
    if (!e.model.empty()) arg("model", quoted(e.model));
    if (e.call >= 0) arg("call", std::to_string(e.call));
    if (!e.job.empty()) arg("job", quoted(e.job));
    if (e.stage >= 0) arg("stage", std::to_string(e.stage));
    if (e.layer_begin >= 0) {
      arg("layers",
          quoted("[" + std::to_string(e.layer_begin) + ", " + std::to_string(e.layer_end) + ")"));
    }
    if (e.microbatch >= 0) arg("microbatch", std::to_string(e.microbatch));
    if (e.bytes >= 0) arg("bytes", std::to_string(e.bytes));
    os << "}}";
  }
  os << "]}\n";
  return os.str();
}

void write_chrome_trace(const std::string& path, const std::vector<TraceEvent>& events,
                        const std::vector<std::string>& device_names) {
  try {
    write_file_atomically(path, chrome_trace_json(events, device_names));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "cannot write the trace: ", e.what_without_backtrace());
  }
}

}  // namespace roundpipe
