// The baselines RoundPipe is compared with: GPipe and 1F1B pipelines of
// fixed stages on the simulator's modeled devices (simulator.h,
// sim_timeline.h).
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "schedule/sim_timeline.h"
#include "schedule/simulator.h"

namespace roundpipe {
namespace {

using sim::bubble;
using sim::EventEngine;
using sim::kNone;
using sim::throughput;
using sim::Timeline;

void check_costs(const StageCosts& s, int64_t num_microbatch, double link_gbps) {
  const size_t p = s.fwd_ms.size();
  TORCH_CHECK_VALUE(p >= 1, "simulate_pipeline: no stage; fwd_ms needs one entry per stage");
  TORCH_CHECK_VALUE(s.bwd_ms.size() == p && (s.output_bytes.empty() || s.output_bytes.size() == p),
                    "simulate_pipeline: ", p, " fwd_ms entries but ", s.bwd_ms.size(),
                    " bwd_ms and ", s.output_bytes.size(),
                    " output_bytes: give one of each per stage");
  for (size_t i = 0; i < p; ++i) {
    TORCH_CHECK_VALUE(std::isfinite(s.fwd_ms[i]) && s.fwd_ms[i] >= 0 &&
                          std::isfinite(s.bwd_ms[i]) && s.bwd_ms[i] >= 0,
                      "simulate_pipeline: stage ", i, " costs fwd ", s.fwd_ms[i], " ms, bwd ",
                      s.bwd_ms[i], " ms: stage times must be finite and >= 0");
    TORCH_CHECK_VALUE(s.output_bytes.empty() || s.output_bytes[i] >= 0, "simulate_pipeline: stage ",
                      i, " has output_bytes ", s.output_bytes[i], ": must be >= 0");
  }
  TORCH_CHECK_VALUE(num_microbatch >= 1, "simulate_pipeline: num_microbatch must be >= 1, got ",
                    num_microbatch);
  TORCH_CHECK_VALUE(link_gbps > 0, "simulate_pipeline: link_gbps must be > 0 GB/s, got ", link_gbps,
                    " (use infinity for free transfers)");
}

}  // namespace

const char* pipeline_schedule_name(PipelineSchedule schedule) {
  return schedule == PipelineSchedule::kGPipe ? "GPipe" : "1F1B";
}

StageCosts split_pipeline_stages(const LayerCosts& costs, int64_t num_stages, bool recompute) {
  worst_stage_ms(ModelExecutePlan{{LayerRange{0, costs.num_layers()}}, {}}, costs,
                 RunKind::kInfer);  // validates the costs
  const int64_t n = costs.num_layers();
  TORCH_CHECK_VALUE(num_stages >= 1 && num_stages <= n, "split_pipeline_stages: cannot split ", n,
                    " layers into ", num_stages, " stages; ask for 1 to ", n);
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t l = 0; l < n; ++l) {
    prefix[l + 1] =
        prefix[l] + costs.fwd_ms[l] + costs.bwd_ms[l] + (recompute ? costs.recompute_ms[l] : 0);
  }
  // best[s][e]: the smallest largest stage time of s stages over layers [0, e).
  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(num_stages + 1, std::vector<double>(n + 1, kInf));
  std::vector<std::vector<int64_t>> cut(num_stages + 1, std::vector<int64_t>(n + 1, 0));
  best[0][0] = 0;
  for (int64_t s = 1; s <= num_stages; ++s) {
    for (int64_t e = s; e <= n; ++e) {
      for (int64_t b = s - 1; b < e; ++b) {
        const double t = std::max(best[s - 1][b], prefix[e] - prefix[b]);
        if (t < best[s][e]) {
          best[s][e] = t;
          cut[s][e] = b;
        }
      }
    }
  }
  std::vector<LayerRange> stages(num_stages);
  for (int64_t s = num_stages, e = n; s >= 1; e = cut[s][e], --s) stages[s - 1] = {cut[s][e], e};
  StageCosts out;
  for (const LayerRange& r : stages) {
    double f = 0, b = 0;
    for (int64_t l = r.begin; l < r.end; ++l) {
      f += costs.fwd_ms[l];
      b += costs.bwd_ms[l] + (recompute ? costs.recompute_ms[l] : 0);
    }
    out.fwd_ms.push_back(f);
    out.bwd_ms.push_back(b);
    out.output_bytes.push_back(costs.activation_bytes.empty() ? 0
                                                              : costs.activation_bytes[r.end - 1]);
  }
  return out;
}

SimResult simulate_pipeline(PipelineSchedule schedule, const StageCosts& stages,
                            int64_t num_microbatch, double link_gbps) {
  check_costs(stages, num_microbatch, link_gbps);
  const int64_t p = static_cast<int64_t>(stages.fwd_ms.size());
  const int64_t m = num_microbatch;
  auto bytes = [&](int64_t i) { return stages.output_bytes.empty() ? 0 : stages.output_bytes[i]; };

  // Each device's compute order: (backward?, microbatch).
  std::vector<std::vector<std::pair<bool, int64_t>>> order(p);
  for (int64_t i = 0; i < p; ++i) {
    const int64_t warm = schedule == PipelineSchedule::kGPipe ? m : std::min(p - i - 1, m);
    for (int64_t k = 0; k < warm; ++k) order[i].emplace_back(false, k);
    for (int64_t k = 0; k < m - warm; ++k) {
      order[i].emplace_back(false, warm + k);
      order[i].emplace_back(true, k);
    }
    for (int64_t k = m - warm; k < m; ++k) order[i].emplace_back(true, k);
  }

  Timeline tl(p, link_gbps, /*copy_delay_ms=*/0);
  auto event = [&](const char* kind, const std::string& name, bool bwd, int64_t i, int64_t k) {
    TraceEvent e;
    e.kind = kind;
    e.name = name;
    e.model = pipeline_schedule_name(schedule);
    e.call = 0;
    e.job = bwd ? "backward" : "forward";
    e.stage = i;
    e.microbatch = k;
    return e;
  };
  auto label = [](bool bwd, int64_t i, int64_t k) {
    return std::string(bwd ? "bwd" : "fwd") + " s" + std::to_string(i) + " mb" + std::to_string(k);
  };
  // [backward?][stage][microbatch]: compute tasks, then their outputs on the host.
  std::vector<std::vector<int>> none(p, std::vector<int>(m, kNone));
  std::vector<std::vector<int>> task[2] = {none, none}, sent[2] = {none, none};
  for (int64_t i = 0; i < p; ++i) {
    for (auto [bwd, k] : order[i]) {
      task[bwd][i][k] = tl.add(i, TraceLane::kCompute, bwd ? stages.bwd_ms[i] : stages.fwd_ms[i],
                               event("compute", label(bwd, i, k), bwd, i, k));
    }
  }
  // Downloads in each producer's compute order, uploads in each consumer's.
  for (int64_t i = 0; i < p; ++i) {
    for (auto [bwd, k] : order[i]) {
      if (bwd ? i == 0 : i == p - 1) continue;
      sent[bwd][i][k] =
          tl.transfer(i, TraceLane::kDownload, bytes(bwd ? i - 1 : i), task[bwd][i][k], kNone,
                      event("handoff", "out " + label(bwd, i, k), bwd, i, k));
    }
  }
  for (int64_t i = 0; i < p; ++i) {
    for (auto [bwd, k] : order[i]) {
      if (bwd ? i == p - 1 : i == 0) continue;
      const int64_t from = bwd ? i + 1 : i - 1;
      const int in =
          tl.transfer(i, TraceLane::kActUpload, bytes(bwd ? i : i - 1), sent[bwd][from][k], kNone,
                      event("handoff", "in " + label(bwd, i, k), bwd, i, k));
      tl.depend(task[bwd][i][k], in);
    }
  }
  tl.run();
  SimResult r = tl.summary(m);
  r.iterations = r.measured_iterations = 1;
  return r;
}

}  // namespace roundpipe
