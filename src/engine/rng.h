// Random streams keyed by (seed, call, layer, microbatch).
//
// A layer run that may draw random numbers sets the generator of its device
// from the key, so recomputation repeats dropout masks exactly and results do
// not depend on which device ran a job. CPU virtual devices all share the
// process's one CPU generator, so keyed runs on them are serialized by a lock;
// a layer that was seen not to draw (per training mode) runs unlocked.
//
// Thread-safety: thread-safe.
#pragma once

#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>

namespace roundpipe {

// The lock of the process's CPU generator: hold it to draw from (or save and
// restore) that generator without disturbing keyed runs on other devices.
std::mutex& cpu_generator_lock();

uint64_t stream_seed(uint64_t seed, int64_t call, int64_t layer, int64_t microbatch);

// Whether a layer may draw random numbers, learned per training mode.
struct RandomUse {
  std::atomic<bool> may_draw[2] = {{true}, {true}};  // [eval, train]
};

// Runs `fn` with `device`'s default generator seeded with `seed`; restores the
// generator afterwards. If `use` says the layer does not draw, runs `fn`
// directly; after a keyed run that drew nothing, records that.
void run_with_random_stream(c10::Device device, uint64_t seed, bool training, RandomUse& use,
                            const std::function<void()>& fn);

}  // namespace roundpipe
