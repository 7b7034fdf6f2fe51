// GradScaler: per-epoch scales, per-optimizer step counts, and the scale
// chain folded in update(). See include/roundpipe/grad_scaler.h for the rules.
#include "roundpipe/grad_scaler.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "engine/optimizer_thread.h"
#include "optim/checks.h"
#include "optim/kernels/kernels.h"
#include "util/value_tree.h"

namespace roundpipe {
namespace {

// torch keeps the scale in a float32 tensor: every scale is a float value.
double to_float(double v) { return static_cast<double>(static_cast<float>(v)); }

void check_scale(double v, const char* what) {
  TORCH_CHECK_VALUE(std::isfinite(v) && v > 0, "GradScaler: ", what,
                    " must be finite and > 0, got ", v);
  TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(v)) && static_cast<float>(v) > 0,
                    "GradScaler: ", what,
                    " must be representable as a positive float32 (the scale's type), got ", v);
}
void check_growth_factor(double v) {
  TORCH_CHECK_VALUE(std::isfinite(v) && v > 1, "GradScaler: growth_factor must be > 1, got ", v);
}
void check_backoff_factor(double v) {
  TORCH_CHECK_VALUE(v > 0 && v < 1, "GradScaler: backoff_factor must be in (0, 1), got ", v);
}
void check_growth_interval(int64_t v) {
  TORCH_CHECK_VALUE(v >= 1, "GradScaler: growth_interval must be >= 1, got ", v);
}

// Multiplies every gradient by inv_scale in place; returns whether any
// element was inf or NaN before scaling (as torch's unscale kernel).
bool unscale_and_check(const std::vector<at::Tensor>& grads, float inv_scale) {
  for (const at::Tensor& g : grads) {
    TORCH_CHECK_VALUE(g.defined(), "GradScaler: a gradient passed to unscale is undefined");
    TORCH_CHECK_TYPE(g.layout() == at::kStrided,
                     "GradScaler: only dense gradients can be unscaled, got layout ", g.layout());
    TORCH_CHECK_TYPE(at::isFloatingType(g.scalar_type()),
                     "GradScaler: gradients must be floating point, got ", g.scalar_type());
    TORCH_CHECK_VALUE(
        g.scalar_type() != at::kHalf,
        "GradScaler: attempting to unscale FP16 gradients; keep float32 optimizer copies "
        "(RoundPipeOptions::set_optim_dtype(at::kFloat))");
  }
  at::NoGradGuard no_grad;
  bool found = false;
  for (const at::Tensor& g : grads) {
    if (g.device().is_cpu() && g.scalar_type() == at::kFloat && g.is_contiguous()) {
      found |= optim::kernels::unscale_and_check(g.data_ptr<float>(), g.numel(), inv_scale);
      optim::detail::bump_version(g);
    } else {
      found |= !at::isfinite(g).all().item<bool>();
      if (inv_scale != 1.0f) g.mul_(static_cast<double>(inv_scale));
    }
  }
  return found;
}

std::vector<at::Tensor> grads_of(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads;
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
  }
  return grads;
}

uintptr_t key_of(const torch::optim::Optimizer& optimizer) {
  return reinterpret_cast<uintptr_t>(&optimizer);
}

double number(const c10::Dict<std::string, c10::IValue>& state, const char* key) {
  auto it = state.find(key);
  TORCH_CHECK_VALUE(it != state.end(), "GradScaler.load_state_dict: missing key '", key, "'");
  const c10::IValue& v = it->value();
  TORCH_CHECK_TYPE(v.isDouble() || v.isInt(), "GradScaler.load_state_dict: '", key,
                   "' must be a number, got ", v.tagKind());
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}

int64_t integer(const c10::Dict<std::string, c10::IValue>& state, const char* key) {
  auto it = state.find(key);
  TORCH_CHECK_VALUE(it != state.end(), "GradScaler.load_state_dict: missing key '", key, "'");
  const c10::IValue& v = it->value();
  TORCH_CHECK_TYPE(v.isInt(), "GradScaler.load_state_dict: '", key, "' must be an integer, got ",
                   v.tagKind());
  return v.toInt();
}

}  // namespace

class GradScaler::Impl {
 public:
  explicit Impl(const GradScalerOptions& o)
      : main_thread(std::this_thread::get_id()),
        enabled(o.enabled),
        growth_factor(o.growth_factor),
        backoff_factor(o.backoff_factor),
        growth_interval(o.growth_interval) {
    check_scale(o.init_scale, "init_scale");
    check_growth_factor(o.growth_factor);
    check_backoff_factor(o.backoff_factor);
    check_growth_interval(o.growth_interval);
    epochs.push_back(Epoch::starting(to_float(o.init_scale)));
    chain_scale = epochs.back().scale;
  }

  // Epoch e: its scale S_e, and what update() recorded when closing it.
  struct Epoch {
    double scale = 0;
    bool closed = false;  // update() ended it and recorded the fields below
    double growth_factor = 0;
    double backoff_factor = 0;
    int64_t growth_interval = 0;
    c10::optional<double> new_scale;  // update(new_scale): replaces the fold of step e
    bool found_inf = false;           // some optimizer's step e saw inf/NaN

    static Epoch starting(double scale) {
      Epoch e;
      e.scale = scale;
      return e;
    }
  };
  // One optimizer's progress.
  struct Optimizer {
    int64_t next_step = 0;
    bool unscaled = false;   // its step next_step has been unscaled
    bool found_inf = false;  // ... and saw inf/NaN
    int64_t context = 0;     // where it acted last (see step_context)

    // The step it is working on: being unscaled, or the one it took last.
    int64_t current_step() const { return unscaled ? next_step : next_step - 1; }
  };

  // ---- everything below: guarded by mu ----

  int64_t current_epoch() const { return first_epoch + static_cast<int64_t>(epochs.size()) - 1; }
  Epoch& epoch(int64_t e) { return epochs.at(static_cast<size_t>(e - first_epoch)); }
  double main_scale() const { return epochs.back().scale; }

  // Which step_fn a call belongs to: the optimizer thread's step task (> 0);
  // without RoundPipe, the epoch (< 0), since a plain step j runs in epoch j.
  int64_t step_context() const {
    const int64_t task = current_step_task();
    return task > 0 ? task : -(current_epoch() + 1);
  }

  // The optimizer `key`, registered at its first use, and marked as acting in
  // the current step context.
  Optimizer& join(uintptr_t key) {
    const int64_t context = step_context();
    auto it = optimizers.find(key);
    if (it == optimizers.end()) {
      // A new optimizer takes the step of those that acted in the same
      // step_fn; else the oldest step not every optimizer has taken (the next
      // one, when they are in step).
      int64_t start = std::numeric_limits<int64_t>::max(), same_context = start;
      for (const auto& [k, o] : optimizers) {
        start = std::min(start, o.next_step);
        if (o.context == context) same_context = std::min(same_context, o.current_step());
      }
      if (optimizers.empty()) start = chain_index;
      if (same_context != std::numeric_limits<int64_t>::max()) start = same_context;
      Optimizer o;
      o.next_step = std::max(start, first_epoch);
      it = optimizers.emplace(key, o).first;
    }
    it->second.context = context;
    return it->second;
  }

  bool complete(int64_t j) const {
    if (optimizers.empty()) return false;
    for (const auto& [k, o] : optimizers) {
      if (o.next_step <= j) return false;
    }
    return true;
  }

  // Whether step j's part of the chain is known: replaced by update(new_scale), or complete.
  bool settled(int64_t j) {
    const Epoch& e = epoch(j);
    return (e.closed && e.new_scale.has_value()) || complete(j);
  }

  // Whether the chain can be folded up to state_target (once the epochs are closed).
  bool ready(int64_t target) {
    for (int64_t j = chain_index; j < target; ++j) {
      if (!settled(j)) return false;
    }
    return true;
  }

  // Folds closed epochs into the chain, up to state_target at most, while the
  // steps are known. Returns whether state_target was reached.
  bool fold_to(int64_t target) {
    while (chain_index < target && chain_index <= current_epoch() && epoch(chain_index).closed) {
      Epoch& e = epoch(chain_index);
      if (e.new_scale) {
        chain_scale = *e.new_scale;  // the tracker is kept, as torch's update(new_scale)
      } else if (!complete(chain_index)) {
        break;
      } else if (e.found_inf) {
        chain_scale = std::min(chain_scale, to_float(e.scale * e.backoff_factor));
        chain_tracker = 0;
      } else if (++chain_tracker == e.growth_interval) {
        const double grown = to_float(chain_scale * e.growth_factor);
        if (std::isfinite(grown)) chain_scale = grown;
        chain_tracker = 0;
      }
      ++chain_index;
    }
    prune();
    return chain_index == target;
  }

  // Drops epochs no optimizer and no fold needs any more (never the current).
  void prune() {
    int64_t lo = chain_index;
    for (const auto& [k, o] : optimizers) lo = std::min(lo, o.next_step);
    while (first_epoch < lo && epochs.size() > 1) {
      epochs.pop_front();
      ++first_epoch;
    }
  }

  // The scale of the step the last-used optimizer is about to take (before
  // any optimizer: of the step the first one will join at).
  double optimizer_view_scale() const {
    const int64_t j = last_key ? optimizers.at(*last_key).next_step : chain_index;
    if (j < first_epoch || j > current_epoch()) return main_scale();
    return epochs[static_cast<size_t>(j - first_epoch)].scale;
  }

  double view_scale() const {
    return on_optimizer_thread() ? optimizer_view_scale() : main_scale();
  }

  // ---- not holding mu ----

  // Waits until the chain can be folded up to state_target, first letting the
  // optimizer thread run what is queued. Throws when that made no progress.
  void wait_ready(int64_t target) {
    for (;;) {
      int64_t seen;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (ready(target)) return;
        seen = steps_recorded;
      }
      run_on_optimizer_thread([] {});
      std::unique_lock<std::mutex> lock(mu);
      if (cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return ready(target); })) return;
      if (steps_recorded == seen) {
        int64_t missing = chain_index;
        while (missing < target && settled(missing)) ++missing;
        TORCH_CHECK(
            false, "GradScaler.update(): no scaler.step() was recorded for this iteration (step ",
            missing, " of ", optimizers.empty() ? "any optimizer" : "every optimizer",
            " is missing, and nothing queued on the optimizer thread recorded it). Call "
            "scaler.step(optimizer) for every optimizer (inside step_fn) before scaler.update()");
      }
    }
  }

  void unscale_here(uintptr_t key, const std::vector<at::Tensor>& grads) {
    int64_t j;
    float inv_scale;
    {
      std::lock_guard<std::mutex> lock(mu);
      Optimizer& o = join(key);
      TORCH_CHECK(
          !o.unscaled,
          "unscale_() has already been called on this optimizer since the last step. Call it at "
          "most once per optimizer before step() (step() unscales when it was not called)");
      j = o.next_step;
      // A step taken before update() closed the previous iteration (several
      // steps in one iteration) belongs to an epoch that has not begun: its
      // gradients were produced with the current scale.
      inv_scale = static_cast<float>(1.0 / (j <= current_epoch() ? epoch(j).scale : main_scale()));
      o.unscaled = true;
      last_key = key;
    }
    bool found;
    try {
      found = unscale_and_check(grads, inv_scale);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      optimizers.at(key).unscaled = false;
      throw;
    }
    std::lock_guard<std::mutex> lock(mu);
    optimizers.at(key).found_inf = found;
    if (found) {
      if (j <= current_epoch()) {
        epoch(j).found_inf = true;
      } else {
        early_inf.insert(j);  // recorded in its epoch when that begins
      }
    }
  }

  bool prepare_step_here(uintptr_t key, const std::vector<at::Tensor>& grads) {
    bool unscaled;
    {
      std::lock_guard<std::mutex> lock(mu);
      unscaled = join(key).unscaled;
    }
    if (!unscaled) unscale_here(key, grads);
    bool found;
    {
      std::lock_guard<std::mutex> lock(mu);
      Optimizer& o = optimizers.at(key);
      found = o.found_inf;
      ++o.next_step;
      o.unscaled = false;
      o.found_inf = false;
      last_key = key;
      ++steps_recorded;
      prune();
    }
    cv.notify_all();
    return !found;
  }

  const std::thread::id main_thread;
  const bool enabled;
  mutable std::mutex mu;
  std::condition_variable cv;  // a step was recorded
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
  std::set<int64_t> early_inf;  // steps with an inf/NaN taken before their epoch began
  std::deque<Epoch> epochs;     // first_epoch .. current epoch; back() is the main view
  int64_t first_epoch = 0;
  std::unordered_map<uintptr_t, Optimizer> optimizers;
  c10::optional<uintptr_t> last_key;
  // The chain: state_{chain_index} = (chain_scale, chain_tracker).
  int64_t chain_index = 0;
  double chain_scale = 0;
  int64_t chain_tracker = 0;
  int64_t applied = 0;  // the chain state the main view's scale came from
  int64_t steps_recorded = 0;
};

GradScaler::GradScaler(GradScalerOptions options) : impl_(std::make_unique<Impl>(options)) {}
GradScaler::~GradScaler() = default;

at::Tensor GradScaler::scale(const at::Tensor& outputs) const {
  if (!impl_->enabled || !outputs.defined()) return outputs;
  double s;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    s = impl_->view_scale();
  }
  return outputs * s;
}

c10::IValue GradScaler::scale(const c10::IValue& outputs) const {
  if (!impl_->enabled) return outputs;
  double s;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    s = impl_->view_scale();
  }
  return map_tensors(outputs, [s](const at::Tensor& t) { return t.defined() ? t * s : t; });
}

void GradScaler::unscale_grads(uintptr_t key, const std::vector<at::Tensor>& grads) {
  if (!impl_->enabled) return;
  run_on_optimizer_thread([&] { impl_->unscale_here(key, grads); });
}

bool GradScaler::prepare_step(uintptr_t key, const std::vector<at::Tensor>& grads) {
  if (!impl_->enabled) return true;
  bool go = false;
  run_on_optimizer_thread([&] { go = impl_->prepare_step_here(key, grads); });
  return go;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!impl_->enabled) return;
  // The gradients are read where the optimizer lives, after queued steps.
  run_on_optimizer_thread([&] { impl_->unscale_here(key_of(optimizer), grads_of(optimizer)); });
}

c10::optional<at::Tensor> GradScaler::step(torch::optim::Optimizer& optimizer,
                                           torch::optim::Optimizer::LossClosure closure) {
  if (!impl_->enabled) return optimizer.step(std::move(closure));
  TORCH_CHECK(!closure,
              "Closure use is not currently supported if GradScaler is enabled: the gradients "
              "the closure computes would not be unscaled");
  c10::optional<at::Tensor> result;
  run_on_optimizer_thread([&] {
    if (impl_->prepare_step_here(key_of(optimizer), grads_of(optimizer))) result = optimizer.step();
  });
  return result;
}

void GradScaler::update(c10::optional<double> new_scale, bool is_async) {
  if (!impl_->enabled) return;
  Impl& m = *impl_;
  TORCH_CHECK(
      std::this_thread::get_id() == m.main_thread,
      "GradScaler.update() must be called on the thread that created the scaler (the main training "
      "thread), not inside loss_fn or step_fn");
  if (new_scale) check_scale(*new_scale, "new_scale");
  int64_t k, target;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    k = m.current_epoch();
    target = new_scale ? k + 1 : std::max(m.applied, is_async ? k : k + 1);
  }
  if (!new_scale) m.wait_ready(target);
  std::lock_guard<std::mutex> lock(m.mu);
  Impl::Epoch& closing = m.epoch(k);
  closing.closed = true;
  closing.growth_factor = m.growth_factor;
  closing.backoff_factor = m.backoff_factor;
  closing.growth_interval = m.growth_interval;
  double next;
  if (new_scale) {
    closing.new_scale = to_float(*new_scale);
    next = *closing.new_scale;
    m.applied = target;
    m.fold_to(target);  // as far as the steps are known; the rest later
  } else {
    const bool reached = m.fold_to(target);
    TORCH_INTERNAL_ASSERT(reached, "GradScaler: the chain did not reach state ", target);
    next = m.chain_scale;
    m.applied = target;
  }
  m.epochs.push_back(Impl::Epoch::starting(next));
  if (m.early_inf.erase(m.current_epoch()) > 0) m.epochs.back().found_inf = true;
}

double GradScaler::get_scale() const {
  if (!impl_->enabled) return 1.0;
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->view_scale();
}

double GradScaler::get_growth_factor(bool /*up_to_date*/) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->growth_factor;
}

void GradScaler::set_growth_factor(double value) {
  check_growth_factor(value);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->growth_factor = value;
}

double GradScaler::get_backoff_factor() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->backoff_factor;
}

void GradScaler::set_backoff_factor(double value) {
  check_backoff_factor(value);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->backoff_factor = value;
}

int64_t GradScaler::get_growth_interval() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->growth_interval;
}

void GradScaler::set_growth_interval(int64_t value) {
  check_growth_interval(value);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->growth_interval = value;
}

bool GradScaler::is_enabled() const { return impl_->enabled; }

c10::Dict<std::string, c10::IValue> GradScaler::state_dict() const {
  // (libtorch has no default constructor for a dict of IValues.)
  auto out = c10::impl::toTypedDict<std::string, c10::IValue>(
      c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
  if (!impl_->enabled) return out;
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  m.fold_to(m.applied);  // the tracker of the state behind the main view, as far as known
  out.insert("scale", m.main_scale());
  out.insert("growth_factor", m.growth_factor);
  out.insert("backoff_factor", m.backoff_factor);
  out.insert("growth_interval", m.growth_interval);
  out.insert("_growth_tracker", m.chain_tracker);
  return out;
}

void GradScaler::load_state_dict(const c10::Dict<std::string, c10::IValue>& state) {
  if (!impl_->enabled) return;
  TORCH_CHECK(state.size() > 0,
              "GradScaler.load_state_dict: the source state dict is empty, possibly because "
              "it was saved from a disabled instance of GradScaler");
  const double scale = number(state, "scale");
  const double growth = number(state, "growth_factor");
  const double backoff = number(state, "backoff_factor");
  const int64_t interval = integer(state, "growth_interval");
  const int64_t tracker = integer(state, "_growth_tracker");
  check_scale(scale, "scale");
  check_growth_factor(growth);
  check_backoff_factor(backoff);
  check_growth_interval(interval);
  TORCH_CHECK_VALUE(tracker >= 0, "GradScaler.load_state_dict: _growth_tracker must be >= 0, got ",
                    tracker);
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  m.growth_factor = growth;
  m.backoff_factor = backoff;
  m.growth_interval = interval;
  const int64_t k = m.current_epoch();
  m.epochs.back().scale = to_float(scale);
  // The chain restarts here: steps of earlier epochs no longer affect it.
  m.chain_index = k;
  m.chain_scale = to_float(scale);
  m.chain_tracker = tracker;
  m.applied = k;
  m.prune();
}

}  // namespace roundpipe
