// Random streams keyed by (seed, call, layer, microbatch).
//
// A layer run that may draw random numbers sets the generator of its device
// from the key, so recomputation repeats dropout masks exactly and results do
// not depend on which device ran a job. CPU virtual devices all share the
// process's one CPU generator, so keyed runs on them are serialized by a lock.
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

// The lock of the process's CPU generator: hold it to draw from (or save and
// restore) that generator without disturbing keyed runs on other devices.
std::mutex& cpu_generator_lock();

// A generator's state, read or written under the generator's own mutex: other
// threads (Python's included) may draw from it at any time.
at::Tensor generator_state(at::Generator& gen);
void set_generator_state(at::Generator& gen, const at::Tensor& state);

uint64_t stream_seed(uint64_t seed, int64_t call, int64_t layer, int64_t microbatch);

// Runs `fn` with `device`'s default generator seeded with `seed`, holding
// that generator's lock; restores the generator afterwards.
void run_with_random_stream(c10::Device device, uint64_t seed, const std::function<void()>& fn);

}  // namespace roundpipe
