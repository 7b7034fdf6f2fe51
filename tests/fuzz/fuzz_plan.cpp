// Fuzz target: execution plans (include/roundpipe/plan.h, auto_plan.h).
// Random plans must validate or throw c10::ValueError (never crash or hit
// undefined behaviour); default_plan and auto_plan on random costs must
// return plans that validate, or reject the input with c10::ValueError; an
// internal assertion (a plain c10::Error) counts as a bug. Worst stage times
// and choose_plan are checked on the plans that come out.
#include <fuzzer/FuzzedDataProvider.h>

#include <roundpipe/auto_plan.h>
#include <roundpipe/plan.h>

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

namespace {

using roundpipe::LayerCosts;
using roundpipe::LayerRange;
using roundpipe::ModelExecutePlan;
using roundpipe::RunKind;

// A small value most of the time, now and then an extreme one.
int64_t SomeInt(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return in.ConsumeIntegral<int64_t>();
    case 1: return -in.ConsumeIntegralInRange<int64_t>(0, 3);
    default: return in.ConsumeIntegralInRange<int64_t>(0, 12);
  }
}

// SomeInt scaled up to byte-like sizes (left unscaled where that would overflow).
int64_t SomeBytes(FuzzedDataProvider& in, int64_t max_scale) {
  const int64_t v = SomeInt(in);
  int64_t out;
  return __builtin_mul_overflow(v, in.ConsumeIntegralInRange<int64_t>(1, max_scale), &out) ? v : out;
}

double SomeTime(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 9)) {
    case 0: return in.ConsumeFloatingPoint<double>();  // any double: inf, nan, huge, negative
    case 1: return 0.0;
    case 2: return std::numeric_limits<double>::max() / in.ConsumeIntegralInRange<int>(1, 4);
    default: return in.ConsumeIntegralInRange<int>(0, 1000) / 8.0;
  }
}

std::vector<LayerRange> SomeRanges(FuzzedDataProvider& in) {
  std::vector<LayerRange> out(in.ConsumeIntegralInRange<size_t>(0, 6));
  for (auto& r : out) r = LayerRange{SomeInt(in), SomeInt(in)};
  return out;
}

RunKind SomeKind(FuzzedDataProvider& in) {
  return static_cast<RunKind>(in.ConsumeIntegralInRange<int>(0, 2));
}

// Runs f; returns false on c10::ValueError, aborts on any other c10::Error.
template <typename F>
bool Accepts(F f, const char* what) {
  try {
    f();
    return true;
  } catch (const c10::ValueError&) {
    return false;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: unexpected c10::Error: %s\n", what, e.what_without_backtrace());
    std::abort();
  }
}

void MustValidate(const ModelExecutePlan& plan, int64_t num_layers, RunKind kind, const char* who) {
  if (!Accepts([&] { plan.validate(num_layers, kind); }, who)) {
    std::fprintf(stderr, "%s returned an invalid plan: %s\n", who, plan.to_string().c_str());
    std::abort();
  }
}

LayerCosts SomeCosts(FuzzedDataProvider& in) {
  LayerCosts c;
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, 24);
  const bool ragged = in.ConsumeIntegralInRange<int>(0, 15) == 0;  // mismatched lengths now and then
  const auto len = [&] { return ragged ? in.ConsumeIntegralInRange<size_t>(0, 24) : n; };
  c.fwd_ms.resize(n);
  c.recompute_ms.resize(len());
  c.bwd_ms.resize(len());
  c.param_bytes.resize(len());
  c.activation_bytes.resize(in.ConsumeBool() ? 0 : len());
  for (auto& t : c.fwd_ms) t = SomeTime(in);
  for (auto& t : c.recompute_ms) t = SomeTime(in);
  for (auto& t : c.bwd_ms) t = SomeTime(in);
  for (auto& b : c.param_bytes) b = SomeBytes(in, 1 << 20);
  for (auto& b : c.activation_bytes) b = SomeInt(in);
  return c;
}

// The input of auto_plan, printed before a failure is reported.
void Print(const std::vector<LayerCosts>& models, const roundpipe::AutoPlanOptions& o) {
  const auto doubles = [](const char* name, const std::vector<double>& v) {
    std::fprintf(stderr, "  %s:", name);
    for (double x : v) std::fprintf(stderr, " %.17g", x);
    std::fprintf(stderr, "\n");
  };
  const auto ints = [](const char* name, const std::vector<int64_t>& v) {
    std::fprintf(stderr, "  %s:", name);
    for (int64_t x : v) std::fprintf(stderr, " %lld", static_cast<long long>(x));
    std::fprintf(stderr, "\n");
  };
  std::fprintf(stderr, "auto_plan(run_kind=%d min_stages=%lld upper_threshold=%.17g limit=%lld) of:\n",
               static_cast<int>(o.run_kind), static_cast<long long>(o.min_stages), o.upper_threshold,
               static_cast<long long>(o.model_memory_limit_bytes));
  for (const auto& m : models) {
    doubles("fwd_ms", m.fwd_ms);
    doubles("recompute_ms", m.recompute_ms);
    doubles("bwd_ms", m.bwd_ms);
    ints("param_bytes", m.param_bytes);
    ints("activation_bytes", m.activation_bytes);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);

  // A random plan: validate() decides, and an accepted plan prints.
  ModelExecutePlan plan{SomeRanges(in), SomeRanges(in)};
  const int64_t num_layers = SomeInt(in);
  const RunKind kind = SomeKind(in);
  if (Accepts([&] { plan.validate(num_layers, kind); }, "validate")) (void)plan.to_string();

  // default_plan on random byte sizes and device counts.
  std::vector<int64_t> bytes(in.ConsumeIntegralInRange<size_t>(0, 24));
  for (auto& b : bytes) b = SomeInt(in);
  const int64_t devices = SomeInt(in);
  ModelExecutePlan def;
  if (Accepts([&] { def = roundpipe::default_plan(bytes, devices, kind); }, "default_plan")) {
    MustValidate(def, static_cast<int64_t>(bytes.size()), kind, "default_plan");
  }

  // auto_plan on one to three models planned jointly.
  std::vector<LayerCosts> models(in.ConsumeIntegralInRange<size_t>(0, 3));
  for (auto& m : models) m = SomeCosts(in);
  roundpipe::AutoPlanOptions options;
  options.set_run_kind(SomeKind(in))
      .set_min_stages(SomeInt(in))
      .set_upper_threshold(in.ConsumeBool() ? 1.0 + SomeTime(in) : SomeTime(in))
      .set_model_memory_limit_bytes(SomeBytes(in, 1 << 22));
  std::vector<ModelExecutePlan> plans;
  try {
    plans = roundpipe::auto_plan(models, options);
  } catch (const c10::ValueError&) {
    return 0;
  } catch (const c10::Error& e) {
    Print(models, options);
    std::fprintf(stderr, "auto_plan: unexpected c10::Error: %s\n", e.what_without_backtrace());
    std::abort();
  }
  if (plans.size() != models.size()) std::abort();
  for (size_t i = 0; i < plans.size(); ++i) {
    // Chained models of a fused run: the ones before the last get train plans.
    const bool before_last = options.run_kind == RunKind::kFused && i + 1 < plans.size();
    MustValidate(plans[i], models[i].num_layers(), before_last ? RunKind::kTrain : options.run_kind,
                 "auto_plan");
  }
  // The predicted worst stage time of a returned plan exists, and keeping the
  // current plan against itself is always allowed.
  double worst = 0;
  if (!Accepts([&] { worst = roundpipe::worst_stage_ms(plans, models, options.run_kind); },
               "worst_stage_ms")) {
    std::abort();
  }
  if (std::isnan(worst) || worst < 0) std::abort();
  std::vector<ModelExecutePlan> kept;
  if (!Accepts([&] { kept = roundpipe::choose_plan(plans, plans, models, options.run_kind); },
               "choose_plan") ||
      kept != plans) {
    std::abort();
  }
  return 0;
}
