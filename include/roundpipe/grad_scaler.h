// GradScaler: dynamic loss scaling for mixed-precision training,
// interface-compatible with torch.amp.GradScaler and safe across the three
// threads of RoundPipe training:
//
//   roundpipe::GradScaler scaler;
//   for (...) {
//     model.forward_backward(args, kwargs, label,
//         [&](const c10::IValue& out, const c10::IValue& y) {   // device workers
//           return c10::IValue(scaler.scale(loss(out, y)));
//         });
//     model.step([&] {                                          // optimizer thread
//       scaler.step(opt);
//       opt.zero_grad();
//     });
//     scaler.update();                                          // main thread
//   }
//
// Threads. The "main thread" is the thread that constructed the scaler;
// update() must be called there (c10::Error elsewhere). scale() is called
// inside loss_fn, on device workers, while the main thread waits in
// forward_backward. unscale_() and step() belong on the optimizer thread
// (inside step_fn); called from any other thread they are queued there behind
// the steps already issued (see "Optimizer thread" below) and waited for.
// Every member function is thread-safe; calls for one optimizer must not
// overlap (step_fn runs them one at a time anyway).
//
// Epochs and steps. Epoch e is the time between the e-th and the (e+1)-th
// update() (epoch 0 before the first). The main view's scale S_e is fixed
// during epoch e; scale() and get_scale() on any thread but an optimizer
// thread use it. Each optimizer (identified by its address, or by the `key`
// of the building blocks) counts its steps: its j-th step (from 0) is step j,
// whose gradients were produced in epoch j, so they are unscaled by S_j
// (multiplied by float(1 / S_j), as torch does). found_inf_j: some gradient
// of some optimizer in step j was inf or NaN. An optimizer skips its step when
// one of *its* gradients was non-finite. Step j is complete when every
// optimizer seen so far has taken its step j. An optimizer first seen after
// others joins at the step they are at in the same step_fn (without
// RoundPipe: in the same epoch), else at the oldest step not every optimizer
// has taken. A step j taken before epoch j began (several steps in one
// iteration, without update() between them) was produced with, and is
// unscaled by, the current scale.
//
// The scale chain, independent of timing: state_0 = (init_scale, tracker 0);
// state_{j+1} = f(state_j, found_inf_j, S_j), where
//   found_inf: scale = min(state.scale, S_j * backoff_factor), tracker = 0
//              (a step scaled with an older, larger S_j that overflowed does
//              not back off a second time);
//   else:      tracker += 1; at growth_interval the scale is multiplied by
//              growth_factor (if that stays finite) and tracker = 0.
// Scales are rounded to float32, like torch's scale tensor. The factors and
// interval used for step j are those set when update() closed epoch j. With
// synchronous updates S_j == state_j.scale and this is exactly torch's rule.
//
// update(new_scale, is_async), the k-th call (k = 0, 1, ...), closes epoch k:
//  - new_scale given: the main view becomes new_scale at once, and the chain
//    continues from it: state_{k+1} = (new_scale, state_k's tracker); step
//    k's result is ignored (as torch does).
//  - is_async = false: waits until step k is complete (draining the
//    optimizer thread first), then S_{k+1} = state_{k+1}.scale.
//  - is_async = true (default): S_{k+1} = state_k.scale, which needs only step
//    k-1 (normally complete: RoundPipe::step has at most one step in flight),
//    so a backoff or growth takes effect one update later, like the one-step
//    delay of the parameters.
//  Mixing both never moves the applied chain state backwards. A needed step
//  that was never recorded (nothing queued on the optimizer thread could
//  record it) raises c10::Error "no scaler.step() was recorded".
//
// Optimizer thread. unscale_/step/unscale_grads/prepare_step called on a
// thread that is not a RoundPipe optimizer thread run on the optimizer thread
// of the model that most recently issued a step, after its queued steps; with
// no such model (plain training without RoundPipe) they run on the calling
// thread.
//
// enabled = false: scale() returns its input, step() calls optimizer.step(),
// update() and unscale_() do nothing, get_scale() is 1.0 and state_dict() is
// empty.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/Dict.h>
#include <c10/util/Optional.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace roundpipe {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;

  GradScalerOptions& set_init_scale(double v) { init_scale = v; return *this; }
  GradScalerOptions& set_growth_factor(double v) { growth_factor = v; return *this; }
  GradScalerOptions& set_backoff_factor(double v) { backoff_factor = v; return *this; }
  GradScalerOptions& set_growth_interval(int64_t v) { growth_interval = v; return *this; }
  GradScalerOptions& set_enabled(bool v) { enabled = v; return *this; }
};

class GradScaler {
 public:
  // c10::ValueError unless init_scale is finite and > 0, growth_factor > 1,
  // 0 < backoff_factor < 1 and growth_interval >= 1.
  explicit GradScaler(GradScalerOptions options = {});
  ~GradScaler();
  GradScaler(const GradScaler&) = delete;
  GradScaler& operator=(const GradScaler&) = delete;

  // outputs * the calling thread's scale (a new tensor); `outputs` itself
  // when disabled or undefined.
  at::Tensor scale(const at::Tensor& outputs) const;
  // Every tensor of a tuple/list/dict tree scaled; the structure is kept.
  c10::IValue scale(const c10::IValue& outputs) const;

  // Divides the optimizer's gradients (the defined .grad of every parameter)
  // in place by the scale that produced them and records whether one is inf
  // or NaN. Optional: step() does it when it was not done. c10::Error when
  // called twice for one optimizer in one step; c10::ValueError for float16
  // gradients (as torch: keep fp32 optimizer copies).
  void unscale_(torch::optim::Optimizer& optimizer);

  // Unscales if not done yet, records this optimizer's step, and runs
  // optimizer.step() unless one of its gradients was inf or NaN. Returns what
  // optimizer.step() returned, or nullopt when the step was skipped. Called
  // off the optimizer thread it is run there and its result returned. A
  // closure is only accepted when disabled (torch raises too: the closure's
  // gradients would not be unscaled).
  c10::optional<at::Tensor> step(torch::optim::Optimizer& optimizer,
                                 torch::optim::Optimizer::LossClosure closure = nullptr);

  // Closes the current epoch (see the top of this file). Main thread only.
  // new_scale must be finite and > 0 (c10::ValueError).
  void update(c10::optional<double> new_scale = c10::nullopt, bool is_async = true);

  // The calling thread's scale: the main view's on every thread but an
  // optimizer thread; there, S_j of the step the optimizer used last is about
  // to take (the main view's if that epoch has not begun). 1.0 if disabled.
  double get_scale() const;

  // Factors and interval: the values the next update() records for the
  // epoch it closes (setters take effect from that update on). `up_to_date`
  // is accepted for the Python API; the value returned is always current.
  double get_growth_factor(bool up_to_date = false) const;
  void set_growth_factor(double value);   // > 1, else c10::ValueError
  double get_backoff_factor() const;
  void set_backoff_factor(double value);  // in (0, 1), else c10::ValueError
  int64_t get_growth_interval() const;
  void set_growth_interval(int64_t value);  // >= 1, else c10::ValueError
  bool is_enabled() const;

  // torch.amp.GradScaler's keys: "scale" (the main view), "growth_factor",
  // "backoff_factor", "growth_interval" and "_growth_tracker" (of the chain
  // state behind the main view). Empty when disabled. Call on the main thread.
  c10::Dict<std::string, c10::IValue> state_dict() const;
  // Sets the factors, the main view's scale and the chain state (scale,
  // tracker) for the current epoch; steps of earlier epochs still in flight
  // no longer affect the chain. Ignored when disabled. c10::Error for an
  // empty dict (saved from a disabled scaler), c10::ValueError for a missing
  // key or an invalid value, c10::TypeError for a value of the wrong type.
  void load_state_dict(const c10::Dict<std::string, c10::IValue>& state);

  // Building blocks for optimizers known only by their gradient tensors
  // (language bindings): `key` identifies one optimizer (e.g. its address).
  // Unscales `grads` in place as unscale_() does.
  void unscale_grads(uintptr_t key, const std::vector<at::Tensor>& grads);
  // Unscales `grads` unless unscale_grads already did in this step, records
  // the step of optimizer `key` as taken, and returns whether the optimizer
  // should step (no inf/NaN among its gradients). True when disabled.
  bool prepare_step(uintptr_t key, const std::vector<at::Tensor>& grads);

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace roundpipe
