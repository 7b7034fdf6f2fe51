// The simulator's virtual clock (simulator.h): an event engine over serial
// resources, and D modeled devices with their lanes and links on it. The
// RoundPipe simulation (simulator.cpp) and the GPipe/1F1B baselines
// (pipeline_baselines.cpp) build their task graphs here.
//
// Thread-compatible: one simulation per instance.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "schedule/simulator.h"

namespace roundpipe {
namespace sim {

constexpr int kNone = -1;  // "no task": ready from time 0

// A list scheduler on a virtual clock. Every task occupies one serial
// resource for its duration and starts once the tasks it depends on have
// ended and its resource is free; a free resource takes the waiting task
// that became ready first, then the one added first.
class EventEngine {
 public:
  struct Task {
    int resource;
    double dur;
    std::vector<int> next;  // tasks that depend on this one
    int pending = 0;        // dependencies not ended yet
    double ready = 0, start = 0, end = 0;
  };

  // A resource that runs any number of tasks at once (a pure delay).
  static constexpr int kUnlimited = -1;

  explicit EventEngine(int num_resources) : num_resources_(num_resources) {}

  int add(int resource, double dur) {
    tasks_.push_back(Task{resource, dur, {}});
    return static_cast<int>(tasks_.size()) - 1;
  }

  // `task` starts after `on` ends (kNone: no-op).
  void depend(int task, int on) {
    if (on == kNone) return;
    TORCH_INTERNAL_ASSERT(on != task, "simulator: a task depends on itself");
    tasks_[on].next.push_back(task);
    ++tasks_[task].pending;
  }

  void run() {
    using Running = std::pair<double, int>;  // (end, task)
    std::priority_queue<Running, std::vector<Running>, std::greater<Running>> running;
    std::vector<std::vector<int>> waiting(num_resources_);
    std::vector<char> busy(num_resources_, 0);
    std::vector<int> touched;  // resources that may start a task now
    double now = 0;
    auto enqueue = [&](int id) {
      Task& t = tasks_[id];
      if (t.resource == kUnlimited) {  // starts as soon as it is ready
        t.start = now;
        t.end = now + t.dur;
        running.emplace(t.end, id);
        return;
      }
      waiting[t.resource].push_back(id);
      touched.push_back(t.resource);
    };
    for (size_t id = 0; id < tasks_.size(); ++id) {
      if (tasks_[id].pending == 0) enqueue(static_cast<int>(id));
    }
    size_t ended = 0;
    for (;;) {
      for (int r : touched) {
        if (busy[r] || waiting[r].empty()) continue;
        auto first = std::min_element(waiting[r].begin(), waiting[r].end(), [&](int a, int b) {
          return std::make_pair(tasks_[a].ready, a) < std::make_pair(tasks_[b].ready, b);
        });
        Task& t = tasks_[*first];
        t.start = now;
        t.end = now + t.dur;
        running.emplace(t.end, *first);
        waiting[r].erase(first);
        busy[r] = 1;
      }
      touched.clear();
      if (running.empty()) break;
      now = running.top().first;
      while (!running.empty() && running.top().first == now) {
        const Task& t = tasks_[running.top().second];
        running.pop();
        ++ended;
        if (t.resource != kUnlimited) {
          busy[t.resource] = 0;
          touched.push_back(t.resource);
        }
        for (int n : t.next) {
          tasks_[n].ready = std::max(tasks_[n].ready, now);
          if (--tasks_[n].pending == 0) enqueue(n);
        }
      }
    }
    TORCH_INTERNAL_ASSERT(ended == tasks_.size(), "simulator: ", tasks_.size() - ended,
                          " tasks never became ready (a dependency cycle)");
  }

  const Task& task(int id) const { return tasks_[id]; }
  int size() const { return static_cast<int>(tasks_.size()); }

 private:
  const int num_resources_;
  std::vector<Task> tasks_;
};

// Microbatches per second.
inline double throughput(int64_t microbatches, double ms) {
  return ms > 0 ? 1e3 * static_cast<double>(microbatches) / ms : 0.0;
}

// Idle fraction of `devices` devices' time over `ms`, given their compute time.
inline double bubble(double busy, int64_t devices, double ms) {
  return ms > 0 ? 1.0 - busy / (static_cast<double>(devices) * ms) : 0.0;
}

// D modeled devices on an event engine: each device's four lanes are FIFO,
// the two upload lanes share the host-to-device link, the download lane has
// the device-to-host link. Device -1 is the host (optimizer lane).
class Timeline {
 public:
  Timeline(int64_t num_devices, double link_gbps, double copy_delay_ms)
      : num_devices_(num_devices),
        bytes_per_ms_(link_gbps * 1e6),
        copy_delay_ms_(copy_delay_ms),
        engine_(static_cast<int>(4 * num_devices + 1)),
        last_(num_devices + 1, {kNone, kNone, kNone, kNone, kNone}) {}

  // Adds a task on `lane` of `device` (-1: the host), after that lane's
  // previous task. `event` describes it; its device, lane and times are set
  // here and by run().
  int add(int64_t device, TraceLane lane, double dur_ms, TraceEvent event) {
    const int id = engine_.add(resource(device, lane), dur_ms);
    int& last = last_[device + 1][static_cast<int>(lane)];
    engine_.depend(id, last);
    last = id;
    event.device = device;
    event.lane = lane;
    events_.push_back(std::move(event));
    iteration_of_.push_back(iteration_);
    shown_.push_back(1);
    return id;
  }

  // A zero-time step of `device`'s host side (its worker) after `deps`: not
  // an event of the trace.
  int host_step(int64_t device, const std::vector<int>& deps) {
    const int id = engine_.add(static_cast<int>(3 * num_devices_ + 1 + device), 0.0);
    for (int dep : deps) engine_.depend(id, dep);
    TraceEvent event;
    event.device = device;
    events_.push_back(std::move(event));
    iteration_of_.push_back(iteration_);
    shown_.push_back(0);
    return id;
  }

  // The last task issued on each of `device`'s lanes.
  std::vector<int> lane_ends(int64_t device) const {
    const auto& last = last_[device + 1];
    return {last[static_cast<int>(TraceLane::kParamUpload)],
            last[static_cast<int>(TraceLane::kActUpload)],
            last[static_cast<int>(TraceLane::kCompute)],
            last[static_cast<int>(TraceLane::kDownload)]};
  }

  // A transfer of `bytes` on `lane` of `device` after `after`, issued by the
  // device's worker once `issue` ended: it starts no earlier than the copy
  // delay after that. With no bytes there is nothing to move and the value
  // is ready when `after` ends.
  int transfer(int64_t device, TraceLane lane, int64_t bytes, int after, int issue,
               TraceEvent event) {
    if (bytes == 0) return after;
    event.bytes = bytes;
    const int id = add(device, lane, static_cast<double>(bytes) / bytes_per_ms_, std::move(event));
    depend(id, after);
    depend(id, issue);
    if (copy_delay_ms_ > 0) depend(id, delay(device, copy_delay_ms_, issue));
    return id;
  }

  // A task of `ms` that starts when `after` ends and shares nothing (a
  // copy's delay): not an event of the trace.
  int delay(int64_t device, double ms, int after) {
    const int id = engine_.add(EventEngine::kUnlimited, ms);
    depend(id, after);
    TraceEvent event;
    event.device = device;
    events_.push_back(std::move(event));
    iteration_of_.push_back(iteration_);
    shown_.push_back(0);
    return id;
  }

  void depend(int task, int on) { engine_.depend(task, on); }

  void run() {
    engine_.run();
    for (int id = 0; id < engine_.size(); ++id) {
      events_[id].start_us = engine_.task(id).start * 1e3;
      events_[id].dur_us = engine_.task(id).dur * 1e3;
    }
  }

  double start(int id) const { return engine_.task(id).start; }
  double end(int id) const { return engine_.task(id).end; }
  int size() const { return engine_.size(); }
  bool is_compute(int id) const { return shown_[id] && events_[id].lane == TraceLane::kCompute; }

  // End of the last task of each iteration (after run()).
  std::vector<double> iteration_ends(int64_t iterations) const {
    std::vector<double> ends(iterations, 0.0);
    for (int id = 0; id < size(); ++id) {
      if (events_[id].device < 0 || !shown_[id])
        continue;  // the optimizer is off the critical path
      ends[iteration_of_[id]] = std::max(ends[iteration_of_[id]], end(id));
    }
    return ends;
  }

  // Compute time of all devices inside [from, to].
  double busy_between(double from, double to) const {
    double busy = 0;
    for (int id = 0; id < size(); ++id) {
      if (is_compute(id)) busy += std::max(0.0, std::min(end(id), to) - std::max(start(id), from));
    }
    return busy;
  }

  // The run's figures, taken as one iteration from time 0 to the end.
  SimResult summary(int64_t num_microbatch) const {
    SimResult r;
    r.num_devices = num_devices_;
    r.num_microbatch = num_microbatch;
    r.busy_ms.assign(num_devices_, 0.0);
    for (int id = 0; id < size(); ++id) {
      r.makespan_ms = std::max(r.makespan_ms, end(id));
      if (is_compute(id)) r.busy_ms[events_[id].device] += engine_.task(id).dur;
    }
    r.single_iteration_ms = r.iteration_ms = r.makespan_ms;
    r.single_throughput = r.throughput = throughput(num_microbatch, r.makespan_ms);
    r.single_bubble = r.bubble =
        bubble(busy_between(0, r.makespan_ms), num_devices_, r.makespan_ms);
    for (int id = 0; id < size(); ++id) {
      if (shown_[id]) r.events.push_back(events_[id]);
    }
    return r;
  }

  // Tasks added from now on belong to `iteration`.
  void set_iteration(int64_t iteration) { iteration_ = iteration; }
  int64_t iteration() const { return iteration_; }

 private:
  int resource(int64_t device, TraceLane lane) const {
    if (device < 0) return static_cast<int>(3 * num_devices_);
    switch (lane) {
      case TraceLane::kCompute:
        return static_cast<int>(3 * device);
      case TraceLane::kParamUpload:
      case TraceLane::kActUpload:
        return static_cast<int>(3 * device + 1);
      default:
        return static_cast<int>(3 * device + 2);
    }
  }

  const int64_t num_devices_;
  const double bytes_per_ms_;
  const double copy_delay_ms_;
  EventEngine engine_;
  std::vector<std::array<int, 5>> last_;  // [device + 1][lane]: the lane's last task
  std::vector<TraceEvent> events_;        // [task]
  std::vector<int64_t> iteration_of_;     // [task]
  std::vector<char> shown_;               // [task]: an event of the trace (not a host step)
  int64_t iteration_ = 0;
};

}  // namespace sim
}  // namespace roundpipe
