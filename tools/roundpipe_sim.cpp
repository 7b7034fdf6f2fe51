// roundpipe-sim: predicts RoundPipe's throughput, speedup and bubble on 1..8
// (or given) devices from per-layer costs, with GPipe and 1F1B over the same
// costs for comparison, by driving the real scheduler and auto-planner on
// modeled devices (src/schedule/simulator.h).
//
//   roundpipe-sim --config costs.json [--devices 1,2,4,8] [--trace out.json]
//   roundpipe-sim --timings timings.json --link-gbps 25 --microbatches D+1
//
// A config file:
//   {"link_gbps": 25, "devices": [1, 2, 4, 8], "microbatches": "D+1",
//    "run_kind": "fused", "warmup_iterations": 4, "measured_iterations": 0,
//    "input_bytes": 0, "output_bytes": 0, "optimizer_ms": 0,
//    "executor": "accelerator", "copy_delay_us": 0, "overlap": "full",
//    "models": [{"name": "m", "plan": {"fwd": [[0, 2]], "bwd": [[2, 4], [0, 2]]},
//                "layers": [{"fwd_ms": 1, "recompute_ms": 1, "bwd_ms": 2,
//                            "param_bytes": 100, "activation_bytes": 10,
//                            "repeat": 4}]}]}
// Every key but "models" is optional (defaults as shown; "plan" defaults to
// the auto-planner). A layer needs fwd_ms, recompute_ms and bwd_ms;
// param_bytes and activation_bytes default to 0; "repeat" repeats the entry.
// A timings file ({"format": "roundpipe-timings-1", "models": [...]}) has the
// same "models". Command-line options override the file's values.
// "executor": "cpu" and "copy_delay_us" model CPU devices (whose worker runs
// compute itself) with ROUNDPIPE_CPU_COPY_DELAY_US, to predict a run on them.
//
// Exit status: 0 on success, 2 for bad input (with a message saying what is
// wrong and how to fix it), 1 for anything else.
#include <roundpipe/auto_plan.h>
#include <roundpipe/plan.h>

#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "schedule/plan_search.h"
#include "schedule/simulator.h"

using namespace roundpipe;
using json = nlohmann::json;

namespace {

// Bad input: reported as is, exit status 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void Fail(const std::string& what) { throw InputError(what); }

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) Fail("cannot open '" + path + "': no such file or not readable; check the path");
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    Fail("'" + path + "' is not valid JSON: " + e.what());
  }
}

// Typed reads of JSON values, naming the value's place in messages.
double Number(const json& v, const std::string& where) {
  if (!v.is_number()) Fail(where + " must be a number, got " + v.dump());
  const double x = v.get<double>();
  if (!(x >= 0) || !std::isfinite(x)) {
    Fail(where + " is " + v.dump() + ": it must be a finite number >= 0");
  }
  return x;
}

int64_t Count(const json& v, const std::string& where, int64_t min) {
  if (!v.is_number_integer() || v.get<int64_t>() < min) {
    Fail(where + " must be an integer >= " + std::to_string(min) + ", got " + v.dump());
  }
  return v.get<int64_t>();
}

struct Model {
  std::string name;
  bool timed = true;  // false: the costs are estimates from parameter sizes
  LayerCosts costs;
  std::optional<ModelExecutePlan> plan;
};

std::vector<LayerRange> Ranges(const json& v, const std::string& where) {
  if (!v.is_array()) Fail(where + " must be a list of [begin, end] pairs, got " + v.dump());
  std::vector<LayerRange> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string at = where + "[" + std::to_string(i) + "]";
    if (!v[i].is_array() || v[i].size() != 2)
      Fail(at + " must be a [begin, end] pair, got " + v[i].dump());
    out.push_back(LayerRange{Count(v[i][0], at + "[0]", 0), Count(v[i][1], at + "[1]", 0)});
  }
  return out;
}

ModelExecutePlan PlanFromJson(const json& v, const std::string& where) {
  if (!v.is_object()) Fail(where + " must be an object {\"fwd\": [[b, e], ...], \"bwd\": [...]}");
  ModelExecutePlan plan;
  if (v.contains("fwd")) plan.fwd_plan = Ranges(v["fwd"], where + ".fwd");
  if (v.contains("bwd")) plan.bwd_plan = Ranges(v["bwd"], where + ".bwd");
  return plan;
}

std::vector<Model> ModelsFromJson(const json& doc, const std::string& path) {
  if (!doc.is_object() || !doc.contains("models") || !doc["models"].is_array() ||
      doc["models"].empty()) {
    Fail("'" + path + "' needs a non-empty list \"models\": [{\"name\": ..., \"layers\": [...]}]");
  }
  std::vector<Model> models;
  for (size_t i = 0; i < doc["models"].size(); ++i) {
    const json& m = doc["models"][i];
    const std::string where = path + ": models[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("layers") || !m["layers"].is_array() || m["layers"].empty()) {
      Fail(where + " needs a non-empty list \"layers\"");
    }
    Model model;
    model.name = m.value("name", "model" + std::to_string(i));
    if (m.contains("timed")) {
      if (!m["timed"].is_boolean())
        Fail(where + ".timed must be true or false, got " + m["timed"].dump());
      model.timed = m["timed"].get<bool>();
    }
    LayerCosts& c = model.costs;
    for (size_t l = 0; l < m["layers"].size(); ++l) {
      const json& layer = m["layers"][l];
      const std::string at = where + ".layers[" + std::to_string(l) + "]";
      if (!layer.is_object()) Fail(at + " must be an object with fwd_ms, recompute_ms and bwd_ms");
      for (const char* key : {"fwd_ms", "recompute_ms", "bwd_ms"}) {
        if (!layer.contains(key))
          Fail(at + " has no \"" + key + "\" (milliseconds per microbatch)");
      }
      const int64_t repeat =
          layer.contains("repeat") ? Count(layer["repeat"], at + ".repeat", 1) : 1;
      const double fwd = Number(layer["fwd_ms"], at + ".fwd_ms");
      const double recompute = Number(layer["recompute_ms"], at + ".recompute_ms");
      const double bwd = Number(layer["bwd_ms"], at + ".bwd_ms");
      const int64_t params =
          layer.contains("param_bytes") ? Count(layer["param_bytes"], at + ".param_bytes", 0) : 0;
      const int64_t act = layer.contains("activation_bytes")
                              ? Count(layer["activation_bytes"], at + ".activation_bytes", 0)
                              : 0;
      for (int64_t r = 0; r < repeat; ++r) {
        c.fwd_ms.push_back(fwd);
        c.recompute_ms.push_back(recompute);
        c.bwd_ms.push_back(bwd);
        c.param_bytes.push_back(params);
        c.activation_bytes.push_back(act);
      }
    }
    if (m.contains("plan")) model.plan = PlanFromJson(m["plan"], where + ".plan");
    models.push_back(std::move(model));
  }
  return models;
}

// "9", "D", "D+1", "2*D", "2*D+1": microbatches as a function of D.
struct MicrobatchRule {
  int64_t times = 1, plus = 1;
  bool fixed = false;
  int64_t operator()(int64_t d) const { return fixed ? plus : times * d + plus; }
};

MicrobatchRule ParseMicrobatches(const std::string& text, const std::string& where) {
  std::smatch m;
  static const std::regex fixed(R"(\s*(\d+)\s*)");
  static const std::regex rule(R"(\s*(?:(\d+)\s*\*\s*)?D\s*(?:\+\s*(\d+))?\s*)");
  MicrobatchRule r;
  if (std::regex_match(text, m, fixed)) {
    r.fixed = true;
    r.plus = std::stoll(m[1]);
  } else if (std::regex_match(text, m, rule)) {
    r.times = m[1].matched ? std::stoll(m[1]) : 1;
    r.plus = m[2].matched ? std::stoll(m[2]) : 0;
  } else {
    Fail(where + " is '" + text +
         "': give a count (9) or a rule in D, the device count (D+1, 2*D)");
  }
  if (r(1) < 1) Fail(where + " is '" + text + "': that gives no microbatch; use at least 1");
  return r;
}

IterationOverlap ParseOverlap(const std::string& s, const std::string& where) {
  if (s == "full") return IterationOverlap::kFull;
  if (s == "after-losses") return IterationOverlap::kAfterLosses;
  Fail(where + " is '" + s + "': use full (every iteration issued at once) or after-losses (as the engine runs by "
       "its default)");
}

SimExecutor ParseExecutor(const std::string& s, const std::string& where) {
  if (s == "accelerator") return SimExecutor::kAccelerator;
  if (s == "cpu") return SimExecutor::kCpu;
  Fail(where + " is '" + s + "': use accelerator (GPUs, the default) or cpu (CPU devices)");
}

RunKind ParseRunKind(const std::string& s, const std::string& where) {
  if (s == "fused") return RunKind::kFused;
  if (s == "train") return RunKind::kTrain;
  if (s == "infer") return RunKind::kInfer;
  Fail(where + " is '" + s +
       "': use fused (forward_backward), train (forward then backward) or infer");
}

std::vector<int64_t> ParseDevices(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!std::regex_match(item, std::regex(R"(\s*[1-9]\d*\s*)"))) {
      Fail("--devices '" + s + "': give device counts >= 1 separated by commas, e.g. 1,2,4,8");
    }
    out.push_back(std::stoll(item));
  }
  if (out.empty()) Fail("--devices is empty: give device counts, e.g. 1,2,4,8");
  return out;
}

std::string StageCount(const ModelExecutePlan& p, RunKind kind) {
  if (kind == RunKind::kInfer) return std::to_string(p.fwd_plan.size());
  if (kind == RunKind::kTrain)
    return std::to_string(p.fwd_plan.size()) + "+" + std::to_string(p.bwd_plan.size());
  return std::to_string(p.fwd_plan.size()) + "+1+" + std::to_string(p.bwd_plan.size() - 1);
}

struct Settings {
  std::vector<int64_t> devices{1, 2, 3, 4, 5, 6, 7, 8};
  MicrobatchRule microbatches;           // D+1
  SimOptions options;                    // all but devices and microbatches
  std::optional<ModelExecutePlan> plan;  // --plan; none: the model's own, else auto
  std::string trace;
};

// --plan: "auto", a JSON plan, or a file holding one.
std::optional<ModelExecutePlan> ParsePlan(const std::string& p) {
  if (p == "auto") return std::nullopt;
  const size_t first = p.find_first_not_of(" \t\n");
  if (first == std::string::npos || p[first] != '{')
    return PlanFromJson(ReadJson(p), "--plan file '" + p + "'");
  try {
    return PlanFromJson(json::parse(p), "--plan");
  } catch (const json::parse_error& e) {
    Fail(std::string("--plan is not valid JSON: ") + e.what() +
         "; give auto, {\"fwd\": [[b, e], ...], \"bwd\": [...]} or a file");
  }
}

// The engine searches its automatic plan for fused calls whose iterations
// overlap (on two devices or more).
bool SearchesPlan(const Settings& s) {
  return s.options.run_kind == RunKind::kFused && s.options.overlap == IterationOverlap::kAfterLosses;
}

// The engine's automatic plan: auto_plan's, searched from where it would be.
ModelExecutePlan PlanFor(const Model& m, const Settings& s, int64_t d) {
  if (s.plan) return *s.plan;
  if (m.plan) return *m.plan;
  const ModelExecutePlan balanced =
      auto_plan({m.costs}, AutoPlanOptions().set_run_kind(s.options.run_kind).set_min_stages(d)).at(0);
  if (!SearchesPlan(s) || d < 2) return balanced;
  return search_overlapped_plan(m.costs, balanced, d, s.microbatches(d)).plan;
}

// One table row: RoundPipe on D devices, and the baselines (absent for
// inference or more devices than layers).
struct Row {
  int64_t d = 0, microbatches = 0;
  ModelExecutePlan plan;
  SimResult roundpipe;
  std::optional<SimResult> gpipe, one_f_one_b;
};

Row Run(const Model& m, const Settings& s, int64_t d) {
  Row row;
  row.d = d;
  row.microbatches = s.microbatches(d);
  row.plan = PlanFor(m, s, d);
  try {
    SimOptions o = s.options;
    o.set_num_devices(d).set_num_microbatch(row.microbatches).set_model_name(m.name);
    row.roundpipe = simulate_roundpipe(m.costs, row.plan, o);
  } catch (const c10::ValueError& e) {
    Fail("model '" + m.name + "', D=" + std::to_string(d) + ": " + e.what_without_backtrace());
  }
  if (s.options.run_kind != RunKind::kInfer && d <= m.costs.num_layers()) {
    const StageCosts stages = split_pipeline_stages(m.costs, d);
    row.gpipe =
        simulate_pipeline(PipelineSchedule::kGPipe, stages, row.microbatches, s.options.link_gbps);
    row.one_f_one_b =
        simulate_pipeline(PipelineSchedule::k1F1B, stages, row.microbatches, s.options.link_gbps);
  }
  return row;
}

void Simulate(const Model& m, const Settings& s, bool write_trace) {
  // Everything is simulated before anything is printed, so bad input
  // yields one message and no half table.
  const Row one = Run(m, s, 1);
  std::vector<Row> rows;
  for (int64_t d : s.devices) rows.push_back(d == 1 ? one : Run(m, s, d));

  const RunKind kind = s.options.run_kind;
  std::printf("model '%s': %lld layers, link %g GB/s per direction, %s, %s plan\n", m.name.c_str(),
              (long long)m.costs.num_layers(), s.options.link_gbps,
              kind == RunKind::kFused   ? "forward_backward"
              : kind == RunKind::kTrain ? "forward + backward"
                                        : "forward only",
              s.plan   ? "the given"
              : m.plan ? "the config's"
                       : SearchesPlan(s)
                           ? "auto-planned (min_stages = D), searched by simulation as the engine does with "
                             "iteration overlap"
                           : "auto-planned (min_stages = D)");
  if (!m.timed) std::printf("(its costs are estimates from parameter sizes, not timings)\n");
  std::printf("%3s %4s %8s %9s %8s %8s %8s | %8s %9s | %8s %9s\n", "D", "M", "stages", "mb/s",
              "speedup", "bubble", "single", "GPipe", "mb/s", "1F1B", "mb/s");
  for (const Row& row : rows) {
    const SimResult& r = row.roundpipe;
    std::printf("%3lld %4lld %8s %9.3f %8.2f %7.2f%% %7.2f%% |", (long long)row.d,
                (long long)row.microbatches, StageCount(row.plan, kind).c_str(), r.throughput,
                r.throughput / one.roundpipe.throughput, 100 * r.bubble, 100 * r.single_bubble);
    for (const auto* p : {&row.gpipe, &row.one_f_one_b}) {
      if (*p) {
        std::printf(" %7.2f%% %9.3f |", 100 * (*p)->bubble, (*p)->throughput);
      } else {
        std::printf(" %8s %9s |", "-", "-");
      }
    }
    std::printf("\n");
  }
  std::printf(
      "mb/s: microbatches per second in the steady state of overlapping iterations; speedup: "
      "against D=1; bubble: idle fraction of device compute time (single: one iteration alone); "
      "GPipe and 1F1B: the same layers in D balanced stages, with recomputation\n");
  if (write_trace) {
    const SimResult& last = rows.back().roundpipe;
    std::vector<std::string> names;
    for (int64_t d = 0; d < last.num_devices; ++d) names.push_back("sim:" + std::to_string(d));
    write_chrome_trace(s.trace, last.events, names);
    std::printf("trace of D=%lld (%lld iterations, %zu events) written to %s\n",
                (long long)last.num_devices, (long long)last.iterations, last.events.size(),
                s.trace.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "roundpipe-sim: predicted throughput, speedup and bubble of RoundPipe on modeled devices, "
      "with GPipe and 1F1B over the same costs"};
  std::string config, timings, devices, microbatches, run_kind, executor, overlap, model_name, plan = "auto";
  std::optional<double> link_gbps, optimizer_ms, copy_delay_us;
  std::optional<int64_t> warmup, measured;
  Settings s;
  auto* config_opt =
      app.add_option("--config", config, "JSON file: models with per-layer costs and settings");
  app.add_option("--timings", timings, "recorded timings (format roundpipe-timings-1)")
      ->excludes(config_opt);
  app.add_option("--devices", devices, "device counts to simulate, e.g. 1,2,4,8 (default 1..8)");
  app.add_option("--microbatches", microbatches,
                 "microbatches per iteration: a count or a rule in D (default D+1)");
  app.add_option("--plan", plan,
                 "auto (the auto-planner, min_stages = D), a JSON plan "
                 "{\"fwd\": [[b, e], ...], \"bwd\": [...]} or a file holding one");
  app.add_option("--run-kind", run_kind, "fused (forward_backward, default), train or infer");
  app.add_option("--link-gbps", link_gbps,
                 "link bandwidth per direction per device, GB/s (default 25)");
  app.add_option("--optimizer-ms", optimizer_ms,
                 "host optimizer time per iteration, ms (default 0: not modeled)");
  app.add_option("--executor", executor,
                 "accelerator (GPUs, default) or cpu (CPU devices: compute runs on the worker)");
  app.add_option("--overlap", overlap,
                 "full (every iteration issued at once, default) or after-losses (the engine by "
                 "its default: the next call at the losses, one parameter copy)");
  app.add_option("--copy-delay-us", copy_delay_us,
                 "every copy starts this long after it is issued, us (CPU devices' "
                 "ROUNDPIPE_CPU_COPY_DELAY_US; default 0)");
  app.add_option("--warmup", warmup, "warm-up iterations before measuring (default 4)");
  app.add_option("--measure", measured,
                 "measured iterations (default 0: whole round-robin periods, >= 8)");
  app.add_option("--model", model_name, "simulate only the model of this name");
  app.add_option("--trace", s.trace,
                 "write the timeline of the largest D as a Chrome trace to this file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }

  try {
    if (config.empty() && timings.empty())
      Fail("give --config FILE or --timings FILE (see --help)");
    const std::string path = config.empty() ? timings : config;
    const json doc = ReadJson(path);
    if (!timings.empty() && doc.value("format", "") != "roundpipe-timings-1") {
      Fail("'" + path + "' is not a timings file: its \"format\" must be \"roundpipe-timings-1\"");
    }
    std::vector<Model> models = ModelsFromJson(doc, path);

    // Settings: the file's values, then the command line's.
    SimOptions& o = s.options;
    if (doc.contains("link_gbps")) o.link_gbps = Number(doc["link_gbps"], path + ": link_gbps");
    if (doc.contains("devices")) {
      const json& d = doc["devices"];
      if (!d.is_array() || d.empty())
        Fail(path + ": devices must be a list of device counts, e.g. [1, 2, 4, 8]");
      s.devices.clear();
      for (size_t i = 0; i < d.size(); ++i)
        s.devices.push_back(Count(d[i], path + ": devices[" + std::to_string(i) + "]", 1));
    }
    if (doc.contains("microbatches")) {
      const json& m = doc["microbatches"];
      s.microbatches = ParseMicrobatches(m.is_string() ? m.get<std::string>() : m.dump(),
                                         path + ": microbatches");
    }
    if (doc.contains("run_kind")) {
      if (!doc["run_kind"].is_string())
        Fail(path + ": run_kind must be a string: fused, train or infer");
      o.run_kind = ParseRunKind(doc["run_kind"].get<std::string>(), path + ": run_kind");
    }
    if (doc.contains("warmup_iterations"))
      o.warmup_iterations = Count(doc["warmup_iterations"], path + ": warmup_iterations", 0);
    if (doc.contains("measured_iterations"))
      o.measured_iterations = Count(doc["measured_iterations"], path + ": measured_iterations", 0);
    if (doc.contains("input_bytes"))
      o.input_bytes = Count(doc["input_bytes"], path + ": input_bytes", 0);
    if (doc.contains("output_bytes"))
      o.output_bytes = Count(doc["output_bytes"], path + ": output_bytes", 0);
    if (doc.contains("optimizer_ms"))
      o.optimizer_ms = Number(doc["optimizer_ms"], path + ": optimizer_ms");
    if (doc.contains("executor")) {
      if (!doc["executor"].is_string()) Fail(path + ": executor must be a string: accelerator or cpu");
      o.executor = ParseExecutor(doc["executor"].get<std::string>(), path + ": executor");
    }
    if (doc.contains("overlap")) {
      if (!doc["overlap"].is_string()) Fail(path + ": overlap must be a string: full or after-losses");
      o.overlap = ParseOverlap(doc["overlap"].get<std::string>(), path + ": overlap");
    }
    if (doc.contains("copy_delay_us"))
      o.copy_delay_ms = Number(doc["copy_delay_us"], path + ": copy_delay_us") / 1e3;
    if (!devices.empty()) s.devices = ParseDevices(devices);
    if (!microbatches.empty()) s.microbatches = ParseMicrobatches(microbatches, "--microbatches");
    s.plan = ParsePlan(plan);
    if (!run_kind.empty()) o.run_kind = ParseRunKind(run_kind, "--run-kind");
    if (!executor.empty()) o.executor = ParseExecutor(executor, "--executor");
    if (!overlap.empty()) o.overlap = ParseOverlap(overlap, "--overlap");
    if (copy_delay_us) {
      if (!(*copy_delay_us >= 0) || !std::isfinite(*copy_delay_us))
        Fail("--copy-delay-us must be a finite number >= 0");
      o.copy_delay_ms = *copy_delay_us / 1e3;
    }
    if (link_gbps) o.link_gbps = *link_gbps;
    if (optimizer_ms) o.optimizer_ms = *optimizer_ms;
    if (warmup) o.warmup_iterations = *warmup;
    if (measured) o.measured_iterations = *measured;
    if (!(o.link_gbps > 0)) Fail("the link bandwidth must be > 0 GB/s (--link-gbps or link_gbps)");
    std::sort(s.devices.begin(), s.devices.end());
    s.devices.erase(std::unique(s.devices.begin(), s.devices.end()), s.devices.end());

    if (!model_name.empty()) {
      std::vector<Model> chosen;
      for (Model& m : models) {
        if (m.name == model_name) chosen.push_back(std::move(m));
      }
      if (chosen.empty())
        Fail("--model '" + model_name + "': no model of that name in '" + path + "'");
      models = std::move(chosen);
    }
    for (size_t i = 0; i < models.size(); ++i) {
      if (i > 0) std::printf("\n");
      Simulate(models[i], s, i == 0 && !s.trace.empty());
    }
  } catch (const InputError& e) {
    std::fprintf(stderr, "roundpipe-sim: %s\n", e.what());
    return 2;
  } catch (const json::exception& e) {
    std::fprintf(stderr, "roundpipe-sim: bad JSON: %s\n", e.what());
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "roundpipe-sim: %s\n", e.what_without_backtrace());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "roundpipe-sim: %s\n", e.what());
    return 1;
  }
  return 0;
}
