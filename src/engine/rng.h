// Random streams keyed by (seed, call, layer, microbatch).
//
// A layer run that may draw random numbers sets the generator of its device
// from the key, so recomputation repeats dropout masks exactly and results do
// not depend on which device ran a job. An accelerator's runs take its
// default generator (one lock per generator). A CPU device's runs draw from
// a generator of their worker thread's own, passed to every operator that
// takes a `Generator?` and was given none (rng.cpp), so CPU devices run keyed
// layers at the same time as GPUs do, and the caller's own draws never mix
// with them. Exception on CPU devices: a layer that reads or sets the
// process's generator itself (torch.get_rng_state, torch.manual_seed, or
// torch.utils.checkpoint's preserve_rng_state inside forward) sees the
// process's generator, not its stream.
// Every run is keyed: a layer that drew nothing once may draw the next time
// (dropout that depends on the input), so nothing is learned from a run.
//
// Thread-safety: thread-safe.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <mutex>

namespace roundpipe {

// The lock the engine takes to save, use and restore the process's CPU
// generator (cloning a layer, drawing a model's seed), so that two such uses
// do not interleave. Keyed runs no longer take it.
std::mutex& cpu_generator_lock();

// A generator's state, read or written under the generator's own mutex: other
// threads (Python's included) may draw from it at any time.
at::Tensor generator_state(at::Generator& gen);
void set_generator_state(at::Generator& gen, const at::Tensor& state);

uint64_t stream_seed(uint64_t seed, int64_t call, int64_t layer, int64_t microbatch);

// Makes the operators registered so far take a CPU device's keyed generator:
// call on a model's user thread before each call (cheap unless operators
// were registered since the last time).
void prepare_keyed_runs();

// Runs `fn` with this thread's in-place random fills of CPU tensors
// (normal_, uniform_, bernoulli_, ...) skipped, the tensors left as they
// were: for making a layer's replicas, whose reset() would draw every
// parameter of the layer only for the values to be dropped.
void without_random_fills(const std::function<void()>& fn);

// Runs `fn` drawing from the stream `seed`: on a CPU device from the
// thread's own generator, elsewhere from `device`'s default generator
// seeded with `seed`, holding its lock and restoring it afterwards.
void run_with_random_stream(c10::Device device, uint64_t seed, const std::function<void()>& fn);

}  // namespace roundpipe
