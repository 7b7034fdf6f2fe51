// The device pool shared by every RoundPipe model of the process
// (docs/guide.md, "1. Devices").
//
// Selected once, at first use, by ROUNDPIPE_DEVICES:
//   "cuda"      all visible CUDA devices
//   "cuda:0,2"  the listed CUDA devices
//   "cuda:0x4"  four devices over GPU 0 (also "cuda:0,0,0,0"), each with its
//               own streams and slots, as if separate GPUs: the cross-device
//               path runs on one GPU (their memory statistics are the GPU's)
//   "cpu:N"     N CPU virtual devices (a worker thread and memory account each)
// Default: all CUDA devices if any, else "cpu:1". A malformed value, or
// "cuda" on a machine without CUDA, throws c10::ValueError at first use.
//
// Thread-safety: all functions are thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace roundpipe {

// Number of devices in the pool (fixes the pool on first call).
int64_t get_num_devices();

// Names of the pool's devices, in round-robin order ("cpu:0", "cuda:1", ...).
std::vector<std::string> get_device_names();

struct DeviceMemoryStats {
  std::string device;  // e.g. "cpu:1"
  int64_t allocated_bytes = 0;      // in use now
  int64_t max_allocated_bytes = 0;  // most in use since the last reset
  // Most held from the device since the last reset, cached blocks included
  // (a GPU's caching allocator reserves more than it hands out; a CPU
  // virtual device holds what it allocates: max_allocated_bytes).
  int64_t max_reserved_bytes = 0;
};

// Memory of every device of the pool, in pool order. CPU virtual devices
// count everything their work allocates.
std::vector<DeviceMemoryStats> device_memory_stats();

// Starts a new peak measurement on every device.
void reset_peak_device_memory();

}  // namespace roundpipe
