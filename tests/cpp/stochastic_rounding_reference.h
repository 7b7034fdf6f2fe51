// The stochastic rounding to bf16 of optim/kernels/kernels.h
// (CompactAdamBuffers::sr_seed, add_bf16_stochastic), written out from its
// documentation: the tests' reference, independent of the kernels' code.
#pragma once

#include <cstdint>
#include <cstring>

namespace roundpipe {
namespace testing {

inline uint64_t reference_splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline uint32_t reference_lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The bf16 bits of `f` rounded stochastically as element j under (seed, step).
inline uint16_t reference_bf16_stochastic(float f, uint64_t seed, uint64_t step, uint64_t j) {
  if (f != f) return 0x7FC0;
  const uint64_t key = reference_splitmix64(reference_splitmix64(seed) ^ step);
  const uint32_t r = reference_lowbias32(reference_lowbias32(static_cast<uint32_t>(j) ^ static_cast<uint32_t>(key)) ^
                                         static_cast<uint32_t>(j >> 32) ^ static_cast<uint32_t>(key >> 32));
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>((bits + (r >> 16)) >> 16);
}

}  // namespace testing
}  // namespace roundpipe
