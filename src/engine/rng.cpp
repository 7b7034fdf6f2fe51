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
  at::Tensor saved = gen.get_state();
  gen.set_current_seed(seed);
  try {
    fn();
  } catch (...) {
    gen.set_state(saved);
    throw;
  }
  gen.set_state(saved);
}

}  // namespace roundpipe
