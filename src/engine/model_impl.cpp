// The engine's façade (model_impl.h): making the parts, and the sequences
// that span several of them.
#include "engine/model_impl.h"

#include <ATen/ATen.h>
#include <malloc.h>

#include "engine/checking_arguments.h"
#include "engine/data_parallel.h"
#include "engine/lifetime.h"
#include "engine/rng.h"
#include "engine/shared_devices.h"
#include "engine/trace_recorder.h"
#include "runtime/device_pool.h"

namespace roundpipe {
namespace {

// The devices a model with RoundPipeOptions::max_devices `max` uses. Also
// checks what else would fail only once the user's module has been moved
// into the host store.
int64_t devices_of(int64_t max, const RoundPipeOptions& options) {
  TORCH_CHECK_VALUE(!options.sync_warmup_steps || *options.sync_warmup_steps >= 0,
                    "RoundPipe: sync_warmup_steps must be >= 0, got ", *options.sync_warmup_steps);
  if (options.run_config.num_microbatch())
    check_num_microbatch(*options.run_config.num_microbatch());
  const int64_t pool = DevicePool::instance().size();
  TORCH_CHECK_VALUE(max >= 0 && max <= pool, "RoundPipe: max_devices must be in 0..", pool,
                    " (0 = all devices of the pool), got ", max);
  return max == 0 ? pool : max;
}

std::vector<std::shared_ptr<LayerHandle>> with_replicas(
    std::vector<std::shared_ptr<LayerHandle>> layers, int64_t devices) {
  TORCH_CHECK_VALUE(!layers.empty(), "RoundPipe: the model has no layers");
  for (const auto& layer : layers) layer->make_replicas(static_cast<int>(devices));
  return layers;
}

// The random streams' seed: given, or drawn from the global generator (so
// torch::manual_seed fixes it); with a process group, rank 0's, whose
// parameters and buffers every process starts from too.
uint64_t initial_seed(const RoundPipeOptions& options, HostStore& store,
                      const std::vector<std::shared_ptr<LayerHandle>>& layers) {
  uint64_t seed = 0;
  if (options.seed) {
    seed = *options.seed;
  } else {
    std::lock_guard<std::mutex> lock(cpu_generator_lock());  // devices may be mid keyed run
    seed = static_cast<uint64_t>(at::empty({}, at::kLong).random_().item<int64_t>());
  }
  if (options.process_group) broadcast_model_state(*options.process_group, store, layers, seed);
  return seed;
}

}  // namespace

// The engine's owners (the RoundPipe, forward()'s autograd nodes) may let go
// on any thread: the last release destroys it only where that may wait for
// its threads (engine/lifetime.h).
std::shared_ptr<RoundPipe::Impl> RoundPipe::Impl::create(
    std::vector<std::shared_ptr<LayerHandle>> layers, RoundPipeOptions options,
    torch::nn::Sequential seq) {
  return std::shared_ptr<Impl>(new Impl(std::move(layers), std::move(options), std::move(seq)),
                               [](Impl* impl) { destroy_where_allowed([impl] { delete impl; }); });
}

RoundPipe::Impl::Impl(std::vector<std::shared_ptr<LayerHandle>> layers, RoundPipeOptions options,
                      torch::nn::Sequential seq)
    : name_(options.name),
      defaults_(options.run_config),
      seq_(std::move(seq)),
      layers_(std::move(layers)),
      num_devices_(devices_of(options.max_devices, options)),
      overlap_iterations_(options.overlap_iterations),
      store_(
          (Tracer::instance(),  // starts tracing when ROUNDPIPE_TRACE is set
           std::make_unique<HostStore>(with_replicas(layers_, num_devices_), options.pin_model,
                                       !DevicePool::instance().device(0).torch_device().is_cpu()))),
      planner_(num_devices_, overlap_iterations_, store_->layer_param_bytes()),
      gradients_(GradientSums::sum_dtypes(*store_)),
      optimizer_(name_, *store_, num_layers(),
                 options.sync_warmup_steps.value_or(get_sync_warmup_steps()), options.process_group,
                 options.gradient_reduction),
      pipeline_(name_, layers_, *store_, optimizer_.gate(), planner_.timer(), gradients_,
                SharedDevices::instance(), num_devices_,
                options.process_group ? options.process_group->rank() : 0,
                initial_seed(options, *store_, layers_)) {
  if (defaults_.execute_plan()) planner_.check_model_plan(*defaults_.execute_plan());
  optimizer_.make_copies(options.optim_dtype);
  gradients_ = GradientSums(GradientSums::sum_dtypes(*store_));  // in the copies' dtypes
  // Packing into arenas and cloning replicas freed about the model's size
  // of heap memory: give it back to the system rather than keep it resident.
  malloc_trim(0);
}

RoundPipe::Impl::~Impl() {
  // The steps queued end before the parts go (the pipeline, destroyed
  // first, waits for its calls).
  try {
    optimizer_.drain();
  } catch (...) {
  }
}

void RoundPipe::Impl::train(bool on) {
  if (seq_) {
    seq_->train(on);
  } else {
    for (auto& l : layers_) l->train(on);
  }
}

torch::nn::Sequential& RoundPipe::Impl::sequential() {
  TORCH_CHECK(!seq_.is_empty(), "RoundPipe '", name_, "' was not built from a Sequential");
  return seq_;
}

ModelExecutePlan RoundPipe::Impl::default_execute_plan(RunKind kind) {
  planner_.plan(kind, num_devices_ + 1);  // starts a search if one is due
  planner_.wait_for_search();
  return planner_.plan(kind, num_devices_ + 1);
}

std::vector<std::pair<std::string, at::Tensor>> RoundPipe::Impl::named_state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const std::string prefix = std::to_string(l) + ".";
    for (auto& [name, t] : layers_[l]->named_parameters()) out.emplace_back(prefix + name, t);
    for (auto& [name, t] : layers_[l]->named_buffers()) out.emplace_back(prefix + name, t);
  }
  return out;
}

void RoundPipe::Impl::begin_call(bool raise_step_error) {
  if (DevicePool::instance().device(0).torch_device().is_cpu()) prepare_keyed_runs();
  pipeline_.finish_handed_calls(/*wait=*/false);
  // Jobs wait for their layers' parameters themselves (ParamGate).
  if (raise_step_error) optimizer_.rethrow_step_error();
}

void RoundPipe::Impl::quiesce(bool raise_step_error) {
  pipeline_.finish_in_flight();
  optimizer_.drain();
  pipeline_.finish_handed_calls(/*wait=*/true);  // done with: the steps are
  begin_call(raise_step_error);
}

void RoundPipe::Impl::wait_state_current() {
  if (optimizer_.on_this_thread()) return;
  pipeline_.make_host_buffers_current();
  optimizer_.wait_published();
}

RoundPipe::Impl::State RoundPipe::Impl::export_state() const {
  State s;
  s.pipeline = pipeline_.state();
  s.optimizer = optimizer_.state();
  s.timer = planner_.timer().state();
  s.accumulated = gradients_.by_id();
  for (const HostParam& p : store_->params()) {
    s.master_grad.push_back(p.master.grad());
    s.optim_grad.push_back(p.optim.defined() ? p.optim.grad() : at::Tensor());
  }
  return s;
}

void RoundPipe::Impl::import_state(State s) {
  optimizer_.note_model_versions();  // what the parameters hold now is the engine's
  auto& params = store_->params();
  for (size_t id = 0; id < params.size(); ++id) {
    HostParam& p = params[id];
    if (s.master_grad[id].defined()) {
      p.master.mutable_grad() = s.master_grad[id];
    } else if (p.master.grad().defined()) {
      p.master.mutable_grad().reset();
    }
    if (!p.optim.defined()) continue;
    if (s.optim_grad[id].defined()) {
      p.optim.mutable_grad() = s.optim_grad[id];
    } else if (p.optim.grad().defined()) {
      p.optim.mutable_grad().reset();
    }
  }
  gradients_ = GradientSums(GradientSums::sum_dtypes(*store_), std::move(s.accumulated));
  pipeline_.load_state(s.pipeline);
  optimizer_.load_state(s.optimizer);
  planner_.timer().load_state(s.timer);
}

}  // namespace roundpipe
