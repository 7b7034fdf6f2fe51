#include "roundpipe/timer.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cmath>
#include <cstdio>

namespace roundpipe {

namespace {
std::atomic<bool> g_verbose{false};
}  // namespace

const char* layer_action_name(LayerAction action) {
  switch (action) {
    case LayerAction::kForward: return "fwd";
    case LayerAction::kRecompute: return "re";
    case LayerAction::kBackward: return "bwd";
  }
  return "?";
}

ModelTimer::ModelTimer(int64_t num_layers) : num_layers_(num_layers) {
  TORCH_CHECK_VALUE(num_layers >= 0, "ModelTimer: num_layers must be >= 0, got ", num_layers);
  entries_.resize(static_cast<size_t>(num_layers) * 3);
}

ModelTimer::Entry& ModelTimer::entry(int64_t layer, LayerAction action) {
  TORCH_CHECK_VALUE(layer >= 0 && layer < num_layers_, "ModelTimer: layer ", layer,
                    " is out of range for a model of ", num_layers_, " layers");
  return entries_[static_cast<size_t>(layer) * 3 + static_cast<size_t>(action)];
}

const ModelTimer::Entry& ModelTimer::entry(int64_t layer, LayerAction action) const {
  return const_cast<ModelTimer*>(this)->entry(layer, action);
}

double ModelTimer::unbiased(const Entry& e) {
  return e.biased_mean / (1.0 - std::pow(kDecay, static_cast<double>(e.count)));
}

void ModelTimer::record(int64_t layer, LayerAction action, double ms) {
  TORCH_CHECK_VALUE(std::isfinite(ms) && ms >= 0, "ModelTimer: a record must be a finite time >= 0 ms, got ",
                    ms, " for layer ", layer, " ", layer_action_name(action));
  double estimate = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = entry(layer, action);
    if (!e.warmed_up) {
      e.warmed_up = true;
      return;
    }
    e.biased_mean = kDecay * e.biased_mean + (1.0 - kDecay) * ms;
    ++e.count;
    estimate = unbiased(e);
  }
  if (verbose()) {
    std::fprintf(stderr, "Layer %lld %s  new record: %.3f ms  new estimate: %.3f ms\n",
                 static_cast<long long>(layer), layer_action_name(action), ms, estimate);
  }
}

c10::optional<double> ModelTimer::estimate(int64_t layer, LayerAction action) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Entry& e = entry(layer, action);
  if (e.count == 0) return c10::nullopt;
  return unbiased(e);
}

int64_t ModelTimer::num_records(int64_t layer, LayerAction action) const {
  std::lock_guard<std::mutex> lock(mu_);
  return entry(layer, action).count;
}

void ModelTimer::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Entry& e : entries_) e = Entry();
}

std::vector<ModelTimer::Entry> ModelTimer::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_;
}

void ModelTimer::load_state(const std::vector<Entry>& state) {
  TORCH_CHECK_VALUE(state.size() == entries_.size(), "ModelTimer::load_state: the state has ",
                    state.size() / 3, " layers, the model ", num_layers_);
  for (const Entry& e : state) {
    TORCH_CHECK_VALUE(e.count >= 0 && std::isfinite(e.biased_mean) && e.biased_mean >= 0,
                      "ModelTimer::load_state: invalid entry (count ", e.count, ", mean ", e.biased_mean, ")");
  }
  std::lock_guard<std::mutex> lock(mu_);
  entries_ = state;
}

void ModelTimer::set_verbose(bool on) { g_verbose.store(on); }
bool ModelTimer::verbose() { return g_verbose.load(); }

}  // namespace roundpipe
