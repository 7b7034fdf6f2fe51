#include "engine/rng.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <mutex>

namespace roundpipe {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::mutex& generator_lock(c10::Device device) {
  // One lock per generator: all CPU devices share the CPU generator.
  static std::mutex accel[64];
  if (device.is_cpu()) return cpu_generator_lock();
  return accel[device.index() % 64];
}

at::Generator generator_of(c10::Device device) {
  if (device.is_cpu()) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(device);
}

}  // namespace

// Another thread may draw from the generator while we hold only our lock (the
// generator's own mutex guards each draw): its state is read and written under
// that mutex, or a torn read fails to restore ("Invalid mt19937 state").
at::Tensor generator_state(at::Generator& gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(at::Generator& gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

std::mutex& cpu_generator_lock() {
  static std::mutex mu;
  return mu;
}

uint64_t stream_seed(uint64_t seed, int64_t call, int64_t layer, int64_t microbatch) {
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ static_cast<uint64_t>(call));
  h = splitmix64(h ^ static_cast<uint64_t>(layer));
  return splitmix64(h ^ static_cast<uint64_t>(microbatch)) >> 1;  // keep it positive as int64
}

void run_with_random_stream(c10::Device device, uint64_t seed, const std::function<void()>& fn) {
  std::lock_guard<std::mutex> lock(generator_lock(device));
  at::Generator gen = generator_of(device);
  at::Tensor saved = generator_state(gen);
  {
    std::lock_guard<std::mutex> draw_lock(gen.mutex());
    gen.set_current_seed(seed);
  }
  try {
    fn();
  } catch (...) {
    set_generator_state(gen, saved);
    throw;
  }
  set_generator_state(gen, saved);
}

}  // namespace roundpipe
