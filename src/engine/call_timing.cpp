#include "engine/call_timing.h"

#include <map>
#include <tuple>

namespace roundpipe {

namespace {

double ms_between(const MarkPtr& start, const MarkPtr& end) { return end->ms_since(*start); }

}  // namespace

void record_layer_times(const Call& call, ModelTimer& timer) {
  // (layer, action, microbatch) -> ms
  std::map<std::tuple<int64_t, LayerAction, int64_t>, double> sums;
  for (const JobRecord& record : call.records) {
    // Forward-like time per (layer, microbatch) of this job: the weights that
    // split a backward time over layers whose boundary was not marked.
    std::map<std::pair<int64_t, int64_t>, double> forward_ms;
    for (const LayerTimeRecord& r : record.layer_times) {
      if (r.action != LayerAction::kBackward) {
        forward_ms[{r.layers.begin, r.microbatch}] += ms_between(r.start, r.end);
      }
    }
    for (const LayerTimeRecord& r : record.layer_times) {
      const double ms = ms_between(r.start, r.end);
      const int64_t n = r.layers.end - r.layers.begin;
      if (n == 1) {
        sums[{r.layers.begin, r.action, r.microbatch}] += ms;
        continue;
      }
      double total = 0;
      for (int64_t l = r.layers.begin; l < r.layers.end; ++l) total += forward_ms[{l, r.microbatch}];
      for (int64_t l = r.layers.begin; l < r.layers.end; ++l) {
        const double share = total > 0 ? forward_ms[{l, r.microbatch}] / total : 1.0 / static_cast<double>(n);
        sums[{l, r.action, r.microbatch}] += ms * share;
      }
    }
  }
  // Mean over the microbatches of each (layer, action).
  std::map<std::pair<int64_t, LayerAction>, std::pair<double, int64_t>> means;
  for (const auto& [key, ms] : sums) {
    auto& [total, count] = means[{std::get<0>(key), std::get<1>(key)}];
    total += ms;
    ++count;
  }
  for (const auto& [key, value] : means) {
    // Device clocks can disagree by rounding: never below zero.
    timer.record(key.first, key.second, std::max(0.0, value.first / static_cast<double>(value.second)));
  }
}

std::vector<TraceEvent> call_trace_events(const Call& call) {
  std::vector<TraceEvent> events;
  const int64_t call_id = call.record ? call.record->call_id : -1;
  for (size_t j = 0; j < call.records.size(); ++j) {
    const JobRecord& record = call.records[j];
    if (record.spans.empty()) continue;
    // A device's marks are placed on the host clock through one anchor mark
    // of the same device (exact for host marks; device time otherwise).
    const TimeMark& anchor = *record.spans.front().start;
    auto at_ms = [&](const MarkPtr& mark) { return anchor.host_ms() + mark->ms_since(anchor); };
    for (const SpanRecord& span : record.spans) {
      const JobSpec& job = call.jobs[static_cast<size_t>(span.job)];
      TraceEvent e;
      e.device = call.jobs[j].device;
      e.lane = span.lane;
      e.kind = span.kind;
      e.model = call.model.name;
      e.call = call_id;
      e.job = job_kind_name(job.kind);
      e.stage = job.stage;
      e.layer_begin = job.layers.begin;
      e.layer_end = job.layers.end;
      e.microbatch = span.microbatch;
      e.bytes = span.bytes;
      const double start = at_ms(span.start);
      e.start_us = start * 1000.0;
      e.dur_us = std::max(0.0, at_ms(span.end) - start) * 1000.0;
      // "fwd s2 mb0", "params s2", "grads s3", "act mb1".
      e.name = span.label;
      if (e.kind != "handoff") e.name += " s" + std::to_string(job.stage);
      if (span.microbatch >= 0) e.name += " mb" + std::to_string(span.microbatch);
      events.push_back(std::move(e));
    }
  }
  return events;
}

}  // namespace roundpipe
