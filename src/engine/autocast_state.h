// The caller's autocast (Python's torch.autocast, C++'s at::autocast
// settings) carried to the device workers that run its call's jobs.
//
// Autocast is thread-local: a worker sees none of the caller's unless it is
// carried. A call captures it on the caller's thread when its record is made,
// and every layer run (forward and recomputation) and the loss function of
// that call run under it, on whichever worker, as plain PyTorch runs a model
// and its loss inside `with torch.autocast(...)`. Backward runs as the caller's
// own backward would outside the autocast region: under the state of the
// worker (none), with the dtypes the forward chose.
//
// The workers run with autocast's cast cache off: that cache is global and
// is cleared only when the caller leaves its autocast region, so a cached
// cast of a stage's device parameters would keep them on the device long
// after the stage.
//
// Thread-safety: AutocastState is a value; AutocastScope changes only the
// current thread's state, for its lifetime.
#pragma once

#include <ATen/autocast_mode.h>

#include <array>

namespace roundpipe {

struct AutocastState {
  struct Entry {
    c10::DeviceType type;
    bool enabled;
    at::ScalarType dtype;
  };
  // The device types roundpipe's devices have (CPU virtual devices, CUDA).
  std::array<Entry, 2> entries{{{c10::DeviceType::CPU, false, at::kBFloat16},
                                {c10::DeviceType::CUDA, false, at::kHalf}}};

  static AutocastState of_this_thread() {
    AutocastState s;
    for (Entry& e : s.entries) {
      e.enabled = at::autocast::is_autocast_enabled(e.type);
      e.dtype = at::autocast::get_autocast_dtype(e.type);
    }
    return s;
  }
  bool any_enabled() const {
    for (const Entry& e : entries) {
      if (e.enabled) return true;
    }
    return false;
  }
};

// Sets the current thread's autocast to `state` (cache off) while it lives;
// does nothing when `state` enables no autocast.
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& state) : active_(state.any_enabled()) {
    if (!active_) return;
    saved_ = AutocastState::of_this_thread();
    saved_cache_ = at::autocast::is_autocast_cache_enabled();
    apply(state);
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastScope() {
    if (!active_) return;
    apply(saved_);
    at::autocast::set_autocast_cache_enabled(saved_cache_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  static void apply(const AutocastState& state) {
    for (const AutocastState::Entry& e : state.entries) {
      at::autocast::set_autocast_enabled(e.type, e.enabled);
      at::autocast::set_autocast_dtype(e.type, e.dtype);
    }
  }
  bool active_;
  AutocastState saved_;
  bool saved_cache_ = true;
};

}  // namespace roundpipe
