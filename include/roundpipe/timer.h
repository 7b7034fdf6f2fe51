// Per-layer timing (docs/trace.md, "1. Per-layer timing"): how long each
// layer's forward, recomputation and backward take on the devices, per
// microbatch. The automatic execution plan balances its stages with these
// estimates.
#pragma once

#include <c10/util/Optional.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace roundpipe {

enum class LayerAction { kForward, kRecompute, kBackward };

// "fwd", "re", "bwd".
const char* layer_action_name(LayerAction action);

// Time estimates of one model's layers.
//
// After each call (one iteration: forward, forward_backward, or the backward
// after forward), every (layer, action) that ran gets one record: its time
// per microbatch averaged over the call's microbatches, measured on the
// device (device events on accelerators, the host clock on CPU devices).
// The first record of each (layer, action) is discarded: it carries one-time
// costs (allocator growth, lazy initialization). Later records x_1, x_2, ...
// update a bias-corrected exponential moving average:
//   m_k = kDecay * m_{k-1} + (1 - kDecay) * x_k,   estimate_k = m_k / (1 - kDecay^k)
// so the first kept record is the estimate, and older records fade out.
//
// Backward time per layer: when a stage's backward runs as one autograd pass,
// a hook on each layer's output marks when its gradient is complete; where a
// layer's output holds no tensor that requires grad, the time of the layers
// without a boundary is split in proportion to their forward time.
//
// Thread-safety: thread-safe.
class ModelTimer {
 public:
  static constexpr double kDecay = 0.9;

  explicit ModelTimer(int64_t num_layers = 0);

  int64_t num_layers() const { return num_layers_; }
  // Adds one record (milliseconds, finite and >= 0; c10::ValueError otherwise
  // or when `layer` is out of range). Prints the verbose line when verbose().
  void record(int64_t layer, LayerAction action, double ms);
  // The current estimate, or nullopt before the first kept record.
  c10::optional<double> estimate(int64_t layer, LayerAction action) const;
  // Records kept (not counting the discarded first one).
  int64_t num_records(int64_t layer, LayerAction action) const;
  // Forgets every record.
  void reset();

  // The complete state, for checkpoints: per layer and action (layer-major,
  // then kForward, kRecompute, kBackward): whether the first record was seen,
  // the kept record count, and the biased mean m_k.
  struct Entry {
    bool warmed_up = false;
    int64_t count = 0;
    double biased_mean = 0;
  };
  std::vector<Entry> state() const;
  // Restores a state() of a timer with the same number of layers
  // (c10::ValueError otherwise; the timer is then unchanged).
  void load_state(const std::vector<Entry>& state);

  // When on, every kept record prints one line on stderr:
  //   "Layer {i} {fwd|re|bwd}  new record: {x:.3f} ms  new estimate: {y:.3f} ms"
  // Process-wide; default off.
  static void set_verbose(bool on);
  static bool verbose();

 private:
  Entry& entry(int64_t layer, LayerAction action);
  const Entry& entry(int64_t layer, LayerAction action) const;
  static double unbiased(const Entry& e);

  int64_t num_layers_;
  mutable std::mutex mu_;
  std::vector<Entry> entries_;  // guarded by mu_: [layer * 3 + action]
};

}  // namespace roundpipe
