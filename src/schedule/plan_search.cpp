#include "schedule/plan_search.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "schedule/simulator.h"

namespace roundpipe {
namespace {

// A fused plan as stage lengths in layers: `fwd` from layer 0 up, `bwd` the
// non-fused backward stages deepest first; the fused stage is what is left
// above the forward stages.
struct Lengths {
  std::vector<int64_t> fwd, bwd;
  bool operator==(const Lengths& o) const { return fwd == o.fwd && bwd == o.bwd; }
};

int64_t total_layers(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

Lengths to_lengths(const ModelExecutePlan& plan) {
  Lengths l;
  for (const LayerRange& r : plan.fwd_plan) l.fwd.push_back(r.end - r.begin);
  for (size_t i = 1; i < plan.bwd_plan.size(); ++i) l.bwd.push_back(plan.bwd_plan[i].end - plan.bwd_plan[i].begin);
  return l;
}

ModelExecutePlan to_plan(const Lengths& l, int64_t num_layers) {
  ModelExecutePlan plan;
  int64_t at = 0;
  for (int64_t n : l.fwd) {
    plan.fwd_plan.push_back({at, at + n});
    at += n;
  }
  plan.bwd_plan.push_back({at, num_layers});
  for (int64_t n : l.bwd) {
    plan.bwd_plan.push_back({at - n, at});
    at -= n;
  }
  return plan;
}

// A fixed pseudo-random sequence (xorshift64): equal inputs give equal plans.
struct XorShift {
  uint64_t state;
  uint64_t next() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  }
};

class Search {
 public:
  Search(const LayerCosts& costs, const PlanSearchOptions& o) : c_(costs), o_(o) {
    const int64_t n = costs.num_layers();
    // The costs, and twice the same with every time moved by up to 3 % (a
    // fixed pattern): the search runs on the costs, and of the best plans it
    // saw the one with the shortest mean time over the three is taken, so
    // that it is good under measured times too, not only at one point of a
    // landscape that changes abruptly between neighbouring plans.
    samples_.push_back(costs);
    XorShift random{0x2545F4914F6CDD1Dull};
    auto jitter = [&random] { return 1.0 + 0.03 * (static_cast<double>(random.next() % 2001) / 1000.0 - 1.0); };
    for (int k = 0; k < 2; ++k) {
      LayerCosts moved = costs;
      for (int64_t l = 0; l < n; ++l) {
        moved.fwd_ms[l] *= jitter();
        moved.recompute_ms[l] *= jitter();
        moved.bwd_ms[l] *= jitter();
      }
      samples_.push_back(std::move(moved));
    }
    min_stages_ = std::min(o.min_stages, 2 * n - 1);
    sim_.set_num_devices(o.num_devices)
        .set_num_microbatch(o.num_microbatch)
        .set_run_kind(RunKind::kFused)
        .set_link_gbps(o.link_gbps)
        .set_overlap(o.overlap ? IterationOverlap::kAfterLosses : IterationOverlap::kFull);
  }

  bool valid(const Lengths& l) const {
    const int64_t n = c_.num_layers(), f = total_layers(l.fwd);
    if (l.fwd.empty() || f >= n || total_layers(l.bwd) != f) return false;
    if (static_cast<int64_t>(l.fwd.size() + 1 + l.bwd.size()) < min_stages_) return false;
    for (const auto* pass : {&l.fwd, &l.bwd}) {
      for (int64_t x : *pass) {
        if (x < 1) return false;
      }
    }
    if (o_.model_memory_limit_bytes > 0) {
      const ModelExecutePlan plan = to_plan(l, n);
      for (const auto* ranges : {&plan.fwd_plan, &plan.bwd_plan}) {
        for (const LayerRange& r : *ranges) {
          int64_t bytes = 0;
          for (int64_t i = r.begin; i < r.end; ++i) bytes += c_.param_bytes[i];
          if (4 * bytes > o_.model_memory_limit_bytes) return false;  // as auto_plan: 2 * bytes <= limit / 2
        }
      }
    }
    return true;
  }

  // Simulated time per iteration; infinity once the budget is spent.
  double score(const Lengths& l) {
    if (o_.stop && o_.stop->load(std::memory_order_relaxed)) simulations_ = o_.max_simulations;  // ends every loop
    if (simulations_ >= o_.max_simulations) return std::numeric_limits<double>::infinity();
    ++simulations_;
    const double s = simulate(samples_[0], l);
    consider(l, s);
    return s;
  }

  double simulate(const LayerCosts& costs, const Lengths& l) const {
    const SimResult r = simulate_roundpipe(costs, to_plan(l, c_.num_layers()), sim_);
    return o_.overlap ? r.iteration_ms : r.single_iteration_ms;
  }

  // Of the best plans seen, the one with the shortest mean time over the
  // costs and the two moved copies (see the constructor).
  Lengths most_robust() const {
    Lengths pick;
    double pick_mean = std::numeric_limits<double>::infinity();
    for (const auto& [s, l] : top_) {
      double sum = s;
      for (size_t k = 1; k < samples_.size(); ++k) sum += simulate(samples_[k], l);
      const double mean = sum / static_cast<double>(samples_.size());
      if (mean < pick_mean) {
        pick = l;
        pick_mean = mean;
      }
    }
    return pick;
  }

  // Steepest descent from `l` (score `s`) while fewer than `until`
  // simulations ran.
  void descend(Lengths l, double s, int64_t until) {
    until = std::min(until, o_.max_simulations);
    while (simulations_ < until) {
      Lengths next;
      double next_s = s;
      for (const Lengths& q : neighbours(l)) {
        if (!valid(q) || simulations_ >= until) continue;
        const double qs = score(q);
        if (qs < next_s) {
          next = q;
          next_s = qs;
        }
      }
      if (!(next_s < s)) return;
      l = next;
      s = next_s;
    }
  }

  // The plan's budget filled along the chain (see plan_search.h).
  Lengths greedy(const Lengths& start) const {
    const ModelExecutePlan plan = to_plan(start, c_.num_layers());
    const double budget = worst_stage_ms(plan, c_, RunKind::kFused);
    const int64_t f = total_layers(start.fwd);
    Lengths l;
    auto fill = [&](std::vector<int64_t>& out, bool forward) {
      std::vector<double> times;  // [stage] along the chain
      for (int64_t k = 0; k < f; ++k) {
        const int64_t layer = forward ? k : f - 1 - k;  // in the order the pass runs
        const double t = forward ? c_.fwd_ms[layer] : c_.recompute_ms[layer] + c_.bwd_ms[layer];
        if (out.empty() || times.back() + t > budget) {
          out.push_back(0);
          times.push_back(0);
        }
        ++out.back();
        times.back() += t;
      }
      // A remainder shorter than the stage before it joins that stage.
      if (out.size() >= 2 && times.back() < times[times.size() - 2]) {
        out[out.size() - 2] += out.back();
        out.pop_back();
      }
    };
    fill(l.fwd, true);
    fill(l.bwd, false);
    return l;
  }

  // From the best plan seen, `moves` random neighbours in a row (a kick out
  // of its basin), then steepest descent; until the budget is spent.
  void kick_and_descend(int64_t moves) {
    XorShift random{0x9E3779B97F4A7C15ull};
    while (simulations_ < o_.max_simulations && !top_.empty()) {
      Lengths l = top_.front().second;
      for (int64_t k = 0; k < moves; ++k) {
        std::vector<Lengths> options;
        for (Lengths& q : neighbours(l)) {
          if (valid(q)) options.push_back(std::move(q));
        }
        if (options.empty()) return;
        l = options[random.next() % options.size()];
      }
      descend(l, score(l), o_.max_simulations);
    }
  }

  int64_t simulations() const { return simulations_; }

 private:
  // Keeps the kTop best plans scored, shortest first (the first scored
  // among equals).
  void consider(const Lengths& l, double s) {
    for (const auto& [ts, tl] : top_) {
      if (tl == l) return;
    }
    top_.emplace_back(s, l);
    std::stable_sort(top_.begin(), top_.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    if (top_.size() > kTop) top_.pop_back();
  }

  static constexpr size_t kTop = 6;

  static std::vector<Lengths> neighbours(const Lengths& l) {
    std::vector<Lengths> out;
    for (int side = 0; side < 2; ++side) {
      const std::vector<int64_t>& v = side == 0 ? l.fwd : l.bwd;
      auto variant = [&](auto&& edit) {
        Lengths q = l;
        edit(side == 0 ? q.fwd : q.bwd);
        out.push_back(std::move(q));
      };
      for (size_t i = 0; i + 1 < v.size(); ++i) {
        for (int64_t d : {1, -1}) variant([&](std::vector<int64_t>& w) { w[i] += d, w[i + 1] -= d; });
      }
      for (size_t i = 0; i + 1 < v.size(); ++i) {
        variant([&](std::vector<int64_t>& w) {
          w[i] += w[i + 1];
          w.erase(w.begin() + static_cast<std::ptrdiff_t>(i) + 1);
        });
      }
      for (size_t i = 0; i < v.size(); ++i) {
        if (v[i] < 2) continue;
        variant([&](std::vector<int64_t>& w) {
          const int64_t half = w[i] / 2;
          w.insert(w.begin() + static_cast<std::ptrdiff_t>(i) + 1, w[i] - half);
          w[i] = half;
        });
      }
    }
    // The fused stage's first layer, one up or down.
    for (int64_t d : {1, -1}) {
      Lengths q = l;
      if (q.bwd.empty()) continue;
      q.fwd.back() += d;
      q.bwd.front() += d;
      out.push_back(std::move(q));
    }
    return out;
  }

  const LayerCosts& c_;
  const PlanSearchOptions& o_;
  std::vector<LayerCosts> samples_;
  SimOptions sim_;
  int64_t min_stages_ = 1;
  int64_t simulations_ = 0;
  std::vector<std::pair<double, Lengths>> top_;  // the best plans seen, shortest first
};

}  // namespace

PlanSearchResult search_fused_plan(const LayerCosts& costs, const ModelExecutePlan& start,
                                   const PlanSearchOptions& options) {
  TORCH_CHECK_VALUE(options.num_devices >= 1 && options.num_microbatch >= 1,
                    "search_fused_plan: num_devices and num_microbatch must be >= 1, got ",
                    options.num_devices, " and ", options.num_microbatch);
  TORCH_CHECK_VALUE(options.min_stages >= 1, "search_fused_plan: min_stages must be >= 1, got ",
                    options.min_stages);
  TORCH_CHECK_VALUE(options.model_memory_limit_bytes >= 0,
                    "search_fused_plan: model_memory_limit_bytes must be >= 0 (0 = unlimited), got ",
                    options.model_memory_limit_bytes);
  TORCH_CHECK_VALUE(options.link_gbps > 0, "search_fused_plan: link_gbps must be > 0 GB/s, got ",
                    options.link_gbps, " (infinity: free transfers)");
  TORCH_CHECK_VALUE(options.max_simulations >= 1, "search_fused_plan: max_simulations must be >= 1, got ",
                    options.max_simulations);
  worst_stage_ms(start, costs, RunKind::kFused);  // validates the costs and the plan
  Search search(costs, options);
  const Lengths given = to_lengths(start);
  PlanSearchResult result;
  result.start_ms = search.score(given);
  // A quarter of the budget for each start, the rest for kicks.
  search.descend(given, result.start_ms, options.max_simulations / 4);
  const Lengths greedy = search.greedy(given);
  if (!(greedy == given) && search.valid(greedy)) {
    search.descend(greedy, search.score(greedy), options.max_simulations / 2);
  }
  search.kick_and_descend(2);
  Lengths pick = search.most_robust();
  result.best_ms = search.simulate(costs, pick);
  if (result.best_ms > result.start_ms) {
    pick = given;
    result.best_ms = result.start_ms;
  }
  result.plan = to_plan(pick, costs.num_layers());
  result.simulations = search.simulations();
  return result;
}

PlanSearchResult search_overlapped_plan(const LayerCosts& costs, const ModelExecutePlan& balanced,
                                        int64_t num_devices, int64_t num_microbatch,
                                        const std::atomic<bool>* stop) {
  PlanSearchOptions options;
  options.stop = stop;
  options.num_devices = num_devices;
  options.num_microbatch = num_microbatch;
  options.min_stages = num_devices;
  return search_fused_plan(costs, balanced, options);
}

}  // namespace roundpipe
