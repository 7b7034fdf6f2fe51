// Execution plan validation and the default (byte-balanced) plan
// (roundpipe/plan.h).
#include <roundpipe/plan.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace roundpipe {
namespace {

// Python-style spelling, so messages read like the Python API's plans.
std::string range_str(const LayerRange& r) {
  std::ostringstream os;
  os << "range(" << r.begin << ", " << r.end << ")";
  return os.str();
}

std::string range_str(const std::vector<LayerRange>& rs) {
  std::string s = "[";
  for (size_t i = 0; i < rs.size(); ++i) s += (i ? ", " : "") + range_str(rs[i]);
  return s + "]";
}

// "layer 3 is" or "layers range(2, 5) are": the layers in [begin, end).
std::string layers_are(int64_t begin, int64_t end) {
  if (end - begin == 1) return "layer " + std::to_string(begin) + " is";
  return "layers " + range_str(LayerRange{begin, end}) + " are";
}

void check_ranges_in_model(const std::vector<LayerRange>& rs, const char* which,
                           int64_t num_layers) {
  for (const LayerRange& r : rs) {
    TORCH_CHECK_VALUE(r.begin < r.end, which, " ranges must be non-empty: ", range_str(r),
                      " holds no layer (begin must be < end)");
    TORCH_CHECK_VALUE(r.begin >= 0 && r.end <= num_layers, which, " ranges must lie inside the ",
                      num_layers, " layers of the model ", range_str(LayerRange{0, num_layers}),
                      ": ", range_str(r), " does not");
  }
}

// Forward: ascending, contiguous from layer 0 (the end is checked per kind).
void check_forward_shape(const std::vector<LayerRange>& fwd) {
  if (fwd.empty()) return;
  TORCH_CHECK_VALUE(fwd[0].begin == 0, "forward ranges must start at layer 0: the first is ",
                    range_str(fwd[0]), "; add ", range_str(LayerRange{0, fwd[0].begin}),
                    " before it");
  for (size_t i = 0; i + 1 < fwd.size(); ++i) {
    const LayerRange& a = fwd[i];
    const LayerRange& b = fwd[i + 1];
    TORCH_CHECK_VALUE(b.begin <= a.end, "forward ranges must be contiguous: gap between ",
                      range_str(a), " and ", range_str(b), ", ", layers_are(a.end, b.begin),
                      " in no range");
    TORCH_CHECK_VALUE(b.end > a.begin, "forward ranges must be ascending: ", range_str(a),
                      " is listed before ", range_str(b));
    TORCH_CHECK_VALUE(b.begin == a.end, "forward ranges must not overlap: ",
                      layers_are(std::max(a.begin, b.begin), std::min(a.end, b.end)), " in both ",
                      range_str(a), " and ", range_str(b));
  }
}

// Backward: deepest first, together covering every layer exactly once.
void check_backward_shape(const std::vector<LayerRange>& bwd, int64_t num_layers, RunKind kind) {
  const LayerRange& first = bwd.front();
  const bool first_is_deepest = first.end == num_layers;
  // An ascending list is the likely mistake; say so rather than "gap".
  TORCH_CHECK_VALUE(first_is_deepest || bwd.size() < 2 || bwd[1].begin < first.end,
                    "backward ranges must be listed deepest first: ", range_str(first),
                    " is listed before ", range_str(bwd[1]), "; reverse the list");
  TORCH_CHECK_VALUE(first_is_deepest || kind != RunKind::kFused,
                    "the fused stage (the first backward range) must end at the last layer: it is ",
                    range_str(first), " but the model has ", num_layers, " layers");
  TORCH_CHECK_VALUE(first_is_deepest,
                    "backward ranges must be listed deepest first, so the first must end at the "
                    "last layer: it is ",
                    range_str(first), " but the model has ", num_layers, " layers (",
                    layers_are(first.end, num_layers), " in no range)");
  for (size_t i = 0; i + 1 < bwd.size(); ++i) {
    const LayerRange& a = bwd[i];  // deeper
    const LayerRange& b = bwd[i + 1];
    TORCH_CHECK_VALUE(
        b.end >= a.begin, "backward ranges must cover every layer exactly once: gap between ",
        range_str(b), " and ", range_str(a), ", ", layers_are(b.end, a.begin), " in no range");
    TORCH_CHECK_VALUE(b.begin < a.end,
                      "backward ranges must be listed deepest first: ", range_str(a),
                      " is listed before ", range_str(b));
    TORCH_CHECK_VALUE(b.end == a.begin, "backward ranges must cover every layer exactly once: ",
                      layers_are(std::max(a.begin, b.begin), std::min(a.end, b.end)), " in both ",
                      range_str(b), " and ", range_str(a));
  }
  const LayerRange& last = bwd.back();
  TORCH_CHECK_VALUE(last.begin == 0, "backward ranges must cover every layer exactly once: ",
                    layers_are(0, last.begin), " in no range; the last (shallowest) range ",
                    range_str(last), " must begin at layer 0");
}

// Splits layers [begin, end) into `stages` contiguous non-empty ranges of
// similar byte size: each cut is the prefix sum closest to k/stages of the
// total, ties broken toward an even layer count (so all-zero bytes split by
// count). Cuts are bounded so that every later range keeps at least one layer.
std::vector<LayerRange> partition_by_bytes(const std::vector<int64_t>& bytes, int64_t begin,
                                           int64_t end, int64_t stages) {
  const int64_t n = end - begin;
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + static_cast<double>(bytes[begin + i]);
  const double total = prefix[n];

  std::vector<LayerRange> out;
  int64_t prev = 0;
  for (int64_t k = 1; k <= stages; ++k) {
    int64_t cut = n;
    if (k < stages) {
      const double target = total * static_cast<double>(k) / static_cast<double>(stages);
      cut = prev + 1;
      for (int64_t j = prev + 2; j <= n - (stages - k); ++j) {
        const double d = std::fabs(prefix[j] - target);
        const double best = std::fabs(prefix[cut] - target);
        const bool closer_by_count =
            std::llabs(j * stages - k * n) < std::llabs(cut * stages - k * n);
        if (d < best || (d == best && closer_by_count)) cut = j;
      }
    }
    out.push_back(LayerRange{begin + prev, begin + cut});
    prev = cut;
  }
  return out;
}

}  // namespace

void ModelExecutePlan::validate(int64_t num_layers, RunKind kind) const {
  TORCH_CHECK_VALUE(num_layers >= 1,
                    "ModelExecutePlan::validate: a model must have at least 1 layer, got num_layers=", num_layers);
  check_ranges_in_model(fwd_plan, "forward", num_layers);
  check_ranges_in_model(bwd_plan, "backward", num_layers);
  check_forward_shape(fwd_plan);

  const LayerRange all{0, num_layers};
  if (kind != RunKind::kFused) {
    TORCH_CHECK_VALUE(!fwd_plan.empty(), "the forward plan is empty: it must cover every layer ",
                      range_str(all));
    TORCH_CHECK_VALUE(fwd_plan.back().end == num_layers,
                      "forward ranges must end at the last layer: the last is ",
                      range_str(fwd_plan.back()), "; add ",
                      range_str(LayerRange{fwd_plan.back().end, num_layers}));
  }

  // Inference ignores the backward plan, but one that is given must be valid.
  if (kind == RunKind::kInfer && bwd_plan.empty()) return;
  TORCH_CHECK_VALUE(!bwd_plan.empty(), "the backward plan is empty: ",
                    kind == RunKind::kFused ? "forward_backward()" : "training",
                    " needs backward ranges covering ", range_str(all), ", listed deepest first");
  check_backward_shape(bwd_plan, num_layers, kind);

  if (kind == RunKind::kFused) {
    const LayerRange& fused = bwd_plan.front();
    TORCH_CHECK_VALUE(!fwd_plan.empty() || fused.begin == 0,
                      "the forward plan must end exactly where the fused stage begins: the forward "
                      "plan is empty but the fused stage is ",
                      range_str(fused), "; add forward ranges covering ",
                      range_str(LayerRange{0, fused.begin}));
    if (!fwd_plan.empty()) {
      TORCH_CHECK_VALUE(fwd_plan.back().end == fused.begin,
                        "the forward plan must end exactly where the fused stage begins: the last "
                        "forward range ",
                        range_str(fwd_plan.back()), " ends at layer ", fwd_plan.back().end,
                        " but the fused stage ", range_str(fused), " begins at layer ", fused.begin,
                        "; make the forward ranges cover ", range_str(LayerRange{0, fused.begin}),
                        " and nothing more");
    }
  }
}

std::string ModelExecutePlan::to_string() const {
  return "fwd " + range_str(fwd_plan) + " bwd " + range_str(bwd_plan);
}

ModelExecutePlan default_plan(const std::vector<int64_t>& layer_bytes, int64_t num_devices,
                              RunKind kind) {
  const int64_t num_layers = static_cast<int64_t>(layer_bytes.size());
  TORCH_CHECK_VALUE(num_layers >= 1, "default_plan needs at least 1 layer, got none");
  TORCH_CHECK_VALUE(num_devices >= 1,
                    "default_plan needs at least 1 device, got num_devices=", num_devices);
  for (int64_t i = 0; i < num_layers; ++i) {
    TORCH_CHECK_VALUE(layer_bytes[i] >= 0, "default_plan: layer byte sizes must be >= 0, but layer ", i, " has ",
                      layer_bytes[i]);
  }

  // Two forward stages per device keep every device busy. (Capping the
  // device count first keeps 2 * devices from overflowing.)
  const int64_t fwd_stages = std::min(num_layers, 2 * std::min(num_devices, num_layers));
  // Backward is ~3x forward work, so ~3x as many (smaller) stages.
  const int64_t bwd_stages = std::min(num_layers, 3 * fwd_stages);

  ModelExecutePlan plan;
  if (kind != RunKind::kInfer) {
    plan.bwd_plan = partition_by_bytes(layer_bytes, 0, num_layers, bwd_stages);
    std::reverse(plan.bwd_plan.begin(), plan.bwd_plan.end());  // deepest first
  }
  if (kind == RunKind::kFused) {
    // The fused stage is the deepest backward stage; forward stops where it begins.
    const int64_t fwd_end = plan.bwd_plan.front().begin;
    const int64_t stages = std::min(fwd_end, 2 * std::min(num_devices, fwd_end));
    if (stages > 0) plan.fwd_plan = partition_by_bytes(layer_bytes, 0, fwd_end, stages);
  } else {
    plan.fwd_plan = partition_by_bytes(layer_bytes, 0, num_layers, fwd_stages);
  }
  return plan;
}

}  // namespace roundpipe
