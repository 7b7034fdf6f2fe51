// The automatic execution planner and its hysteresis
// (docs/trace.md, "The default: automatic, with hysteresis").
#include <roundpipe/auto_plan.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace roundpipe {
namespace {

// Chained models of a fused run: only the last runs forward_backward; the
// ones before it run forward with grad, then backward (train plans).
RunKind kind_of_chained(RunKind kind, size_t model, size_t num_models) {
  return kind == RunKind::kFused && model + 1 < num_models ? RunKind::kTrain : kind;
}

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kNoPartition = std::numeric_limits<int64_t>::max();

// "" for a lone model, " of model 2" when several are planned together.
std::string of_model(int64_t index) {
  return index < 0 ? std::string() : " of model " + std::to_string(index);
}

template <typename T>
void check_length(const std::vector<T>& v, const char* name, int64_t n, int64_t model) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(v.size()) == n, "LayerCosts", of_model(model), " has ", n,
                    " fwd_ms entries but ", v.size(), " ", name,
                    " entries: every per-layer vector needs one entry per layer");
}

void check_times(const std::vector<double>& v, const char* name, int64_t model) {
  for (size_t i = 0; i < v.size(); ++i) {
    TORCH_CHECK_VALUE(std::isfinite(v[i]) && v[i] >= 0, name, "[", i, "]", of_model(model), " is ",
                      v[i], ": layer times must be finite and >= 0 milliseconds");
  }
}

void check_bytes(const std::vector<int64_t>& v, const char* name, int64_t model) {
  for (size_t i = 0; i < v.size(); ++i) {
    TORCH_CHECK_VALUE(v[i] >= 0, name, "[", i, "]", of_model(model), " is ", v[i],
                      ": byte sizes must be >= 0");
  }
}

// `model` < 0: a lone model, named in no message.
void check_costs(const LayerCosts& c, int64_t model) {
  const int64_t n = c.num_layers();
  TORCH_CHECK_VALUE(n >= 1, "LayerCosts", of_model(model),
                    " has no layer: fwd_ms must hold one entry per layer");
  check_length(c.recompute_ms, "recompute_ms", n, model);
  check_length(c.bwd_ms, "bwd_ms", n, model);
  check_length(c.param_bytes, "param_bytes", n, model);
  if (!c.activation_bytes.empty()) check_length(c.activation_bytes, "activation_bytes", n, model);
  check_times(c.fwd_ms, "fwd_ms", model);
  check_times(c.recompute_ms, "recompute_ms", model);
  check_times(c.bwd_ms, "bwd_ms", model);
  check_bytes(c.param_bytes, "param_bytes", model);
  check_bytes(c.activation_bytes, "activation_bytes", model);
  // Stage times are sums of layer times, and an infinite time means "no
  // such split" to the planner: every sum must stay finite. (Rounding is
  // monotone, so no stage's sum exceeds this total.)
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += c.fwd_ms[i] + c.recompute_ms[i] + c.bwd_ms[i];
  TORCH_CHECK_VALUE(std::isfinite(total), "LayerCosts", of_model(model),
                    ": the layer times (fwd_ms + recompute_ms + bwd_ms) add up to more than the "
                    "largest double: give them in a larger unit");
}

// Sum of w[begin, end) added in layer order, the one way every stage time is
// computed, so that a time checked against a budget here compares equal to
// the time worst_stage_ms reports for the same stage.
double range_time(const std::vector<double>& w, int64_t begin, int64_t end) {
  double t = 0.0;
  for (int64_t i = begin; i < end; ++i) t += w[i];
  return t;
}

// One pass of one model to split into stages: per-layer times and the
// constraints every stage must meet.
struct Pass {
  std::vector<double> time;           // per layer
  const std::vector<int64_t>* bytes;  // parameter bytes per layer
  const std::vector<int64_t>* act;    // hand-over bytes after each layer; may be empty
  int64_t max_stage_bytes;            // parameter bytes a stage may hold
};

// Fewest stages covering [begin, end) with every stage time <= x and within
// the byte limit, or kNoPartition. Greedy (each stage as long as it may be)
// is optimal: any sub-range of a feasible stage is feasible.
int64_t fewest_stages(const Pass& p, int64_t begin, int64_t end, double x) {
  int64_t stages = 0;
  double t = 0.0;
  int64_t b = 0;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t li = (*p.bytes)[i];
    if (stages == 0 || t + p.time[i] > x || li > p.max_stage_bytes - b) {
      if (p.time[i] > x || li > p.max_stage_bytes) return kNoPartition;
      ++stages;
      t = 0.0;
      b = 0;
    }
    t += p.time[i];
    b += li;
  }
  return stages;
}

uint64_t to_bits(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

double from_bits(uint64_t u) {
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// The smallest worst stage time of `k` stages covering [begin, end) (k <= its
// layer count), or kInf if the byte limit allows no such split. Exact: a
// bisection over the bit patterns of non-negative doubles (ordered like the
// values) ends on adjacent doubles, so the result is a reachable stage time.
double best_bottleneck(const Pass& p, int64_t begin, int64_t end, int64_t k) {
  if (fewest_stages(p, begin, end, kInf) > k) return kInf;
  double lo = 0.0;
  for (int64_t i = begin; i < end; ++i) lo = std::max(lo, p.time[i]);
  if (fewest_stages(p, begin, end, lo) <= k) return lo;
  uint64_t lo_bits = to_bits(lo);                              // not reachable
  uint64_t hi_bits = to_bits(range_time(p.time, begin, end));  // reachable
  while (hi_bits - lo_bits > 1) {
    const uint64_t mid = lo_bits + (hi_bits - lo_bits) / 2;
    if (fewest_stages(p, begin, end, from_bits(mid)) <= k) {
      hi_bits = mid;
    } else {
      lo_bits = mid;
    }
  }
  return from_bits(hi_bits);
}

// Splits [begin, end) into exactly `k` stages, each within time `x` and the
// byte limit (the caller made sure such a split exists). Among such splits,
// each boundary in turn is placed as close as it may to an even share of the
// pass's time, then at the cheaper hand-over, then at an even layer count.
std::vector<LayerRange> split_stages(const Pass& p, int64_t begin, int64_t end, int64_t k,
                                     double x) {
  const int64_t n = end - begin;
  // reach[i]: the furthest end of a stage starting at layer begin + i.
  std::vector<int64_t> reach(n + 1, n);
  for (int64_t i = 0; i < n; ++i) {
    double t = 0.0;
    int64_t b = 0;
    int64_t j = i;
    while (j < n && t + p.time[begin + j] <= x && (*p.bytes)[begin + j] <= p.max_stage_bytes - b) {
      t += p.time[begin + j];
      b += (*p.bytes)[begin + j];
      ++j;
    }
    reach[i] = j;
  }
  // need[i]: fewest stages covering the rest from layer begin + i; it only
  // shrinks as i grows, so "need[i] <= stages left" holds on a suffix.
  std::vector<int64_t> need(n + 1, 0);
  for (int64_t i = n - 1; i >= 0; --i) need[i] = 1 + need[reach[i]];
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + p.time[begin + i];

  std::vector<LayerRange> out;
  int64_t prev = 0;
  for (int64_t stage = 1; stage < k; ++stage) {
    const int64_t left = k - stage;  // stages after this boundary
    const double target = prefix[n] * static_cast<double>(stage) / static_cast<double>(k);
    int64_t cut = -1;
    for (int64_t c = prev + 1; c <= std::min(reach[prev], n - left); ++c) {
      if (need[c] > left) continue;
      if (cut < 0) {
        cut = c;
        continue;
      }
      const double d = std::fabs(prefix[c] - target);
      const double best = std::fabs(prefix[cut] - target);
      const int64_t act = p.act->empty() ? 0 : (*p.act)[begin + c - 1];
      const int64_t best_act = p.act->empty() ? 0 : (*p.act)[begin + cut - 1];
      const int64_t skew = std::llabs(c * k - stage * n);
      const int64_t best_skew = std::llabs(cut * k - stage * n);
      if (d < best || (d == best && (act < best_act || (act == best_act && skew < best_skew)))) {
        cut = c;
      }
    }
    TORCH_INTERNAL_ASSERT(cut > prev, "auto_plan: no boundary for stage ", stage, " of ", k);
    out.push_back(LayerRange{begin + prev, begin + cut});
    prev = cut;
  }
  out.push_back(LayerRange{begin + prev, end});
  return out;
}

// The fewest stages (at least `min_count`) covering [begin, end) within
// `budget`, split with the smallest worst stage time; empty if impossible.
std::vector<LayerRange> plan_pass(const Pass& p, int64_t begin, int64_t end, int64_t min_count,
                                  double budget) {
  const int64_t fewest = fewest_stages(p, begin, end, budget);
  if (fewest == kNoPartition) return {};
  const int64_t k = std::max(fewest, min_count);
  return split_stages(p, begin, end, k, best_bottleneck(p, begin, end, k));
}

// Everything auto_plan derives from one model's costs.
struct Model {
  int64_t n = 0;
  Pass fwd;    // forward stages
  Pass bwd;    // backward stages: recompute + backward
  Pass fused;  // the fused stage: forward + backward
};

Model make_model(const LayerCosts& c, int64_t max_stage_bytes) {
  Model m;
  m.n = c.num_layers();
  m.fwd = Pass{c.fwd_ms, &c.param_bytes, &c.activation_bytes, max_stage_bytes};
  m.bwd = Pass{{}, &c.param_bytes, &c.activation_bytes, max_stage_bytes};
  m.fused = Pass{{}, &c.param_bytes, &c.activation_bytes, max_stage_bytes};
  for (int64_t i = 0; i < m.n; ++i) {
    m.bwd.time.push_back(c.recompute_ms[i] + c.bwd_ms[i]);
    m.fused.time.push_back(c.fwd_ms[i] + c.bwd_ms[i]);
  }
  return m;
}

double max_layer_time(const Pass& p, int64_t end) {
  double t = 0.0;
  for (int64_t i = 0; i < end; ++i) t = std::max(t, p.time[i]);
  return t;
}

// The smallest s for which the fused stage [s, n) fits the byte limit and
// leaves enough layers for min_count stages in all: s layers make at most
// 2s + 1 stages (each layer a forward and a backward stage).
int64_t first_fused_begin(const Model& m, int64_t min_count) {
  const std::vector<int64_t>& bytes = *m.fused.bytes;
  int64_t s = m.n - 1;
  int64_t b = bytes[s];
  while (2 * (s - 1) + 1 >= min_count && bytes[s - 1] <= m.fused.max_stage_bytes - b) b += bytes[--s];
  return s;
}

// The smallest worst stage time any valid plan of this model can reach. Each
// layer on its own stage reaches it, except that a fused plan trades a
// larger fused stage against fewer layers outside it.
double best_reachable(const Model& m, RunKind kind, int64_t min_count) {
  if (kind == RunKind::kInfer) return max_layer_time(m.fwd, m.n);
  if (kind == RunKind::kTrain)
    return std::max(max_layer_time(m.fwd, m.n), max_layer_time(m.bwd, m.n));
  double best = kInf;
  const int64_t first = first_fused_begin(m, min_count);
  for (int64_t s = m.n - 1; s >= first; --s) {
    const double outside = std::max(max_layer_time(m.fwd, s), max_layer_time(m.bwd, s));
    best = std::min(best, std::max(range_time(m.fused.time, s, m.n), outside));
  }
  return best;
}

double worst_of(const Pass& p, const std::vector<LayerRange>& stages) {
  double worst = 0.0;
  for (const LayerRange& r : stages) worst = std::max(worst, range_time(p.time, r.begin, r.end));
  return worst;
}

ModelExecutePlan plan_model(const Model& m, RunKind kind, int64_t min_count, double budget) {
  ModelExecutePlan plan;
  if (kind != RunKind::kFused) {
    plan.fwd_plan = plan_pass(m.fwd, 0, m.n, min_count, budget);
    TORCH_INTERNAL_ASSERT(!plan.fwd_plan.empty(), "auto_plan: budget below a layer's time");
    if (kind == RunKind::kTrain) {
      plan.bwd_plan = plan_pass(m.bwd, 0, m.n, min_count, budget);
      TORCH_INTERNAL_ASSERT(!plan.bwd_plan.empty(), "auto_plan: budget below a layer's time");
      std::reverse(plan.bwd_plan.begin(), plan.bwd_plan.end());  // deepest first
    }
    return plan;
  }

  // Fused: try every fused stage [s, n) within the budget; fewest stages in
  // all wins, then the smallest worst stage time, then the larger fused stage
  // (its layers need no recomputation).
  struct Choice {
    int64_t begin = -1;  // of the fused stage
    int64_t stages = kNoPartition;
    double worst = kInf;
    int64_t fwd_k = 0, bwd_k = 0;
    double fwd_x = 0, bwd_x = 0;
  } best;
  const int64_t first = first_fused_begin(m, min_count);
  for (int64_t s = m.n - 1; s >= first; --s) {
    Choice c;
    c.begin = s;
    c.worst = range_time(m.fused.time, s, m.n);
    if (c.worst > budget) break;  // only grows as s shrinks
    if (s > 0) {
      const int64_t fwd_fewest = fewest_stages(m.fwd, 0, s, budget);
      const int64_t bwd_fewest = fewest_stages(m.bwd, 0, s, budget);
      if (fwd_fewest == kNoPartition || bwd_fewest == kNoPartition) continue;
      // Stages beyond the fewest, when min_count asks for more, go where
      // they lower the worst stage time most.
      const int64_t total = std::max(fwd_fewest + bwd_fewest, min_count - 1);
      if (total > best.stages - 1) continue;
      double chosen = kInf;
      for (int64_t kf = fwd_fewest; kf <= std::min(s, total - bwd_fewest); ++kf) {
        const int64_t kb = total - kf;
        if (kb > s) continue;
        const double fx = best_bottleneck(m.fwd, 0, s, kf);
        const double bx = best_bottleneck(m.bwd, 0, s, kb);
        if (std::max(fx, bx) < chosen) {
          chosen = std::max(fx, bx);
          c.fwd_k = kf;
          c.bwd_k = kb;
          c.fwd_x = fx;
          c.bwd_x = bx;
        }
      }
      if (chosen == kInf) continue;
      c.worst = std::max(c.worst, chosen);
    }
    c.stages = c.fwd_k + c.bwd_k + 1;
    if (c.stages > best.stages) continue;
    if (c.stages < best.stages || c.worst <= best.worst) best = c;
  }
  TORCH_INTERNAL_ASSERT(best.begin >= 0, "auto_plan: no fused stage within budget");
  const int64_t s = best.begin;
  if (s > 0) {
    plan.fwd_plan = split_stages(m.fwd, 0, s, best.fwd_k, best.fwd_x);
    plan.bwd_plan = split_stages(m.bwd, 0, s, best.bwd_k, best.bwd_x);
  }
  plan.bwd_plan.push_back(LayerRange{s, m.n});
  std::reverse(plan.bwd_plan.begin(), plan.bwd_plan.end());  // fused stage first
  return plan;
}

double worst_of_plan(const Model& m, const ModelExecutePlan& plan, RunKind kind) {
  double worst = worst_of(m.fwd, plan.fwd_plan);
  if (kind == RunKind::kInfer) return worst;
  if (kind == RunKind::kTrain) return std::max(worst, worst_of(m.bwd, plan.bwd_plan));
  for (size_t i = 0; i < plan.bwd_plan.size(); ++i) {
    const LayerRange& r = plan.bwd_plan[i];
    worst = std::max(worst, range_time(i == 0 ? m.fused.time : m.bwd.time, r.begin, r.end));
  }
  return worst;
}

void check_min_gain(double min_gain) {
  TORCH_CHECK_VALUE(min_gain >= 0 && min_gain < 1, "choose_plan: min_gain must be in [0, 1), got ",
                    min_gain, " (0.05 switches plans only for a gain above 5%)");
}

bool is_empty(const ModelExecutePlan& p) { return p.fwd_plan.empty() && p.bwd_plan.empty(); }

}  // namespace

std::vector<ModelExecutePlan> auto_plan(const std::vector<LayerCosts>& models,
                                        const AutoPlanOptions& options) {
  TORCH_CHECK_VALUE(!models.empty(), "auto_plan needs the costs of at least one model, got none");
  TORCH_CHECK_VALUE(options.min_stages >= 1, "auto_plan: min_stages must be >= 1, got ",
                    options.min_stages, " (usually the number of devices)");
  TORCH_CHECK_VALUE(std::isfinite(options.upper_threshold) && options.upper_threshold >= 1,
                    "auto_plan: upper_threshold must be finite and >= 1, got ",
                    options.upper_threshold,
                    " (1 asks for the best bottleneck; 1.1 allows 10% more for fewer stages)");
  TORCH_CHECK_VALUE(options.model_memory_limit_bytes >= 0,
                    "auto_plan: model_memory_limit_bytes must be >= 0 (0 = unlimited), got ",
                    options.model_memory_limit_bytes);

  // 2 * stage bytes <= limit / 2, i.e. stage bytes <= limit / 4 (exact in
  // integers).
  const int64_t limit = options.model_memory_limit_bytes;
  const int64_t max_stage_bytes = limit == 0 ? std::numeric_limits<int64_t>::max() : limit / 4;
  const int64_t num_models = static_cast<int64_t>(models.size());
  const auto model_id = [&](int64_t i) { return num_models == 1 ? int64_t{-1} : i; };

  std::vector<Model> built;
  for (int64_t i = 0; i < num_models; ++i) {
    check_costs(models[i], model_id(i));
    const std::vector<int64_t>& bytes = models[i].param_bytes;
    for (size_t l = 0; l < bytes.size(); ++l) {
      TORCH_CHECK_VALUE(bytes[l] <= max_stage_bytes, "auto_plan: layer ", l, of_model(model_id(i)),
                        " has ", bytes[l], " parameter bytes; with its gradients (2 * ", bytes[l],
                        " bytes) it exceeds half of model_memory_limit_bytes=", limit, " (",
                        limit / 2, " bytes), so it fits on no stage: set model_memory_limit_bytes",
                        " >= 4 * ", bytes[l], " or split the layer");
    }
    built.push_back(make_model(models[i], max_stage_bytes));
  }

  // The shared budget: upper_threshold times the best bottleneck reachable
  // by all models together, which is the worst of each model's best.
  // Stage minimum: per pass, or for a fused plan in all (its one call hands
  // every stage to the devices), capped at what the layers allow.
  const auto kind_of = [&](size_t i) { return kind_of_chained(options.run_kind, i, built.size()); };
  const auto min_count = [&](size_t i) {
    const Model& m = built[i];
    return std::min(options.min_stages, kind_of(i) == RunKind::kFused ? 2 * m.n - 1 : m.n);
  };
  double best = 0.0;
  for (size_t i = 0; i < built.size(); ++i) {
    best = std::max(best, best_reachable(built[i], kind_of(i), min_count(i)));
  }
  const double budget = options.upper_threshold * best;

  std::vector<ModelExecutePlan> plans;
  for (size_t i = 0; i < built.size(); ++i) {
    plans.push_back(plan_model(built[i], kind_of(i), min_count(i), budget));
    plans.back().validate(built[i].n, kind_of(i));
  }
  return plans;
}

double worst_stage_ms(const ModelExecutePlan& plan, const LayerCosts& costs, RunKind kind) {
  check_costs(costs, -1);
  plan.validate(costs.num_layers(), kind);
  return worst_of_plan(make_model(costs, std::numeric_limits<int64_t>::max()), plan, kind);
}

double worst_stage_ms(const std::vector<ModelExecutePlan>& plans,
                      const std::vector<LayerCosts>& costs, RunKind kind) {
  TORCH_CHECK_VALUE(plans.size() == costs.size(), "worst_stage_ms: got ", plans.size(),
                    " plans but the costs of ", costs.size(),
                    " models: pass one of each per model");
  double worst = 0.0;
  for (size_t i = 0; i < plans.size(); ++i) {
    worst =
        std::max(worst, worst_stage_ms(plans[i], costs[i], kind_of_chained(kind, i, plans.size())));
  }
  return worst;
}

ModelExecutePlan choose_plan(const ModelExecutePlan& current, const ModelExecutePlan& candidate,
                             const LayerCosts& costs, RunKind kind, double min_gain) {
  check_min_gain(min_gain);
  const double candidate_ms = worst_stage_ms(candidate, costs, kind);
  if (is_empty(current)) return candidate;
  const double current_ms = worst_stage_ms(current, costs, kind);
  return candidate_ms < (1 - min_gain) * current_ms ? candidate : current;
}

std::vector<ModelExecutePlan> choose_plan(const std::vector<ModelExecutePlan>& current,
                                          const std::vector<ModelExecutePlan>& candidate,
                                          const std::vector<LayerCosts>& costs, RunKind kind,
                                          double min_gain) {
  check_min_gain(min_gain);
  TORCH_CHECK_VALUE(candidate.size() == costs.size() && (current.empty() || current.size() == costs.size()),
                    "choose_plan: got ", current.size(), " current plans, ", candidate.size(),
                    " candidate plans and the costs of ", costs.size(),
                    " models: pass one of each per model (or no current plan)");
  const double candidate_ms = worst_stage_ms(candidate, costs, kind);
  if (current.empty()) return candidate;
  const double current_ms = worst_stage_ms(current, costs, kind);
  return candidate_ms < (1 - min_gain) * current_ms ? candidate : current;
}

}  // namespace roundpipe
