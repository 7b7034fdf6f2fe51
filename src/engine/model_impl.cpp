// The engine's façade (model_impl.h): making the parts, and the sequences
// that span several of them.
#include "engine/model_impl.h"

#include <ATen/ATen.h>
#include <malloc.h>

#include "engine/data_parallel.h"
#include "engine/lifetime.h"
#include "engine/rng.h"
#include "engine/trace_recorder.h"
#include "optim/optimizer_thread.h"
#include "runtime/device_pool.h"

namespace roundpipe {
namespace {

// The devices a model with RoundPipeOptions::max_devices `max` uses. Also
// checks what else would fail only once the user's module has been moved
// into the host store.
int64_t devices_of(int64_t max, const RoundPipeOptions& options) {
  TORCH_CHECK_VALUE(!options.sync_warmup_steps || *options.sync_warmup_steps >= 0,
                    "RoundPipe: sync_warmup_steps must be >= 0, got ", *options.sync_warmup_steps);
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

RoundPipe::Impl::Impl(std::vector<std::shared_ptr<LayerHandle>> layers_in, RoundPipeOptions options,
                      torch::nn::Sequential seq_in)
    : name(options.name),
      defaults(options.run_config),
      seq(std::move(seq_in)),
      layers(std::move(layers_in)),
      num_devices(devices_of(options.max_devices, options)),
      overlap_iterations(options.overlap_iterations),
      store(
          (Tracer::instance(),  // starts tracing when ROUNDPIPE_TRACE is set
           std::make_unique<HostStore>(with_replicas(layers, num_devices), options.pin_model,
                                       !DevicePool::instance().device(0).torch_device().is_cpu()))),
      planner(num_devices, overlap_iterations, store->layer_param_bytes()),
      gradients(GradientSums::sum_dtypes(*store)),
      optimizer(name, *store, num_layers(),
                options.sync_warmup_steps.value_or(get_sync_warmup_steps()), options.process_group,
                options.gradient_reduction),
      pipeline(name, layers, *store, optimizer.gate(), planner, gradients, num_devices,
               options.process_group ? options.process_group->rank() : 0,
               initial_seed(options, *store, layers)) {
  if (defaults.num_microbatch()) {
    TORCH_CHECK_VALUE(*defaults.num_microbatch() >= 1, "num_microbatch must be >= 1, got ",
                      *defaults.num_microbatch());
  }
  if (defaults.execute_plan()) planner.check_model_plan(*defaults.execute_plan());
  optimizer.make_copies(options.optim_dtype);
  gradients = GradientSums(GradientSums::sum_dtypes(*store));  // in the copies' dtypes
  // Packing into arenas and cloning replicas freed about the model's size
  // of heap memory: give it back to the system rather than keep it resident.
  malloc_trim(0);
}

RoundPipe::Impl::~Impl() {
  // The calls steps finish belong in the trace too (a trace written at exit
  // shows every call).
  try {
    optimizer.drain();
  } catch (...) {
  }
  for (const auto& call : optimizer.take_finished_calls()) Pipeline::add_to_trace(*call);
}

void RoundPipe::Impl::begin_call(bool raise_step_error) {
  if (DevicePool::instance().device(0).torch_device().is_cpu()) prepare_keyed_runs();
  pipeline.record_finished(optimizer.take_finished_calls());
  // Jobs wait for their layers' parameters themselves (ParamGate).
  if (raise_step_error) optimizer.rethrow_step_error();
}

void RoundPipe::Impl::quiesce(bool raise_step_error) {
  pipeline.finish_in_flight();
  optimizer.drain();
  begin_call(raise_step_error);
}

void RoundPipe::Impl::step(StepFn step_fn, bool is_async) {
  TORCH_CHECK_VALUE(static_cast<bool>(step_fn), "step: step_fn is empty");
  const bool delayed = optimizer.begin_step(is_async);
  // A synchronous step leaves nothing running: the call in flight is
  // applied here (its buffers too), its failure raised before the step.
  if (!delayed) pipeline.finish_in_flight();
  // Where run_on_optimizer_thread goes (the optimizer side lives as long as
  // the model it is posted through is held).
  detail::note_stepping_model(weak_from_this(), [side = &optimizer](std::function<void()> task) {
    side->post(std::move(task));
  });
  // The gradients of every call issued so far: those applied, then the call
  // in flight's (summed on the optimizer thread once its jobs are done),
  // then what synchronize() left in .grad. Later calls sum afresh.
  GradientSums taken = gradients.take(*store);
  GradientSums model_grads = GradientSums::take_model_grads(*store);
  optimizer.step(std::move(step_fn), delayed, std::move(taken), std::move(model_grads),
                 pipeline.take_in_flight());
}

void RoundPipe::Impl::synchronize() {
  quiesce();
  optimizer.catch_up_model();
  gradients.move_to_model_grads(*store);
  // Nothing is running: what the allocator kept of the steps' freed
  // gradients and buffers goes back to the system (a training loop does not
  // call synchronize, so the pages are not faulted in again every step).
  malloc_trim(0);
}

void RoundPipe::Impl::wait_state_current() {
  if (optimizer.on_this_thread()) return;
  pipeline.apply_unwritten_buffers();
  optimizer.wait_published();
}

RoundPipe::Impl::State RoundPipe::Impl::export_state() const {
  State s;
  s.pipeline = pipeline.state();
  s.optimizer = optimizer.state();
  s.timer = planner.timer().state();
  s.accumulated = gradients.by_id();
  for (const HostParam& p : store->params()) {
    s.master_grad.push_back(p.master.grad());
    s.optim_grad.push_back(p.optim.defined() ? p.optim.grad() : at::Tensor());
  }
  return s;
}

void RoundPipe::Impl::import_state(State s) {
  auto& params = store->params();
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
  gradients = GradientSums(GradientSums::sum_dtypes(*store), std::move(s.accumulated));
  pipeline.load_state(s.pipeline);
  optimizer.load_state(s.optimizer);
  planner.timer().load_state(s.timer);
}

}  // namespace roundpipe
