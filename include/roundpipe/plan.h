// Execution plans: how a model's layers are grouped into stages
// (docs/guide.md, "5. Execution plans").
//
// Thread-safety: plain values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace roundpipe {

// Layers [begin, end) of a model; like Python's range(begin, end).
struct LayerRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const LayerRange& o) const { return begin == o.begin && end == o.end; }
  bool operator!=(const LayerRange& o) const { return !(*this == o); }
};

// What a plan is used for.
enum class RunKind {
  kInfer,  // forward() only: the forward plan covers every layer
  kTrain,  // forward() then a separate backward: both plans cover every layer
  kFused,  // forward_backward(): forward stages, then the fused stage, then backward stages
};

struct ModelExecutePlan {
  // Forward stages, ascending and contiguous from layer 0.
  std::vector<LayerRange> fwd_plan;
  // Backward stages, deepest first, covering every layer exactly once. In a
  // fused plan bwd_plan[0] is the fused stage: it starts where fwd_plan ends
  // and ends at the last layer.
  std::vector<LayerRange> bwd_plan;

  bool operator==(const ModelExecutePlan& o) const {
    return fwd_plan == o.fwd_plan && bwd_plan == o.bwd_plan;
  }

  // Checks every rule above (fwd_plan, bwd_plan, RunKind) for a model of
  // `num_layers` layers used as `kind`. Throws c10::ValueError naming the
  // broken rule and the offending ranges, e.g. "backward ranges must cover
  // every layer exactly once: layer 3 is in range(2, 4) and range(3, 5)".
  void validate(int64_t num_layers, RunKind kind) const;

  // "fwd [range(0, 2), range(2, 4)] bwd [range(3, 4), ...]".
  std::string to_string() const;
};

// A plan that is valid for `kind`, built from per-layer parameter bytes: layers
// are grouped into contiguous stages of similar byte size, enough stages to keep
// `num_devices` devices busy, and backward stages about a third the size of
// forward stages (backward work is about 3x forward work). Deterministic.
ModelExecutePlan default_plan(const std::vector<int64_t>& layer_bytes, int64_t num_devices,
                              RunKind kind);

}  // namespace roundpipe
