#include "runtime/device_pool.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <string>
#include <utility>

#include "roundpipe/devices.h"
#include "runtime/fault_injecting_device.h"

namespace roundpipe {
namespace {

// `text` as a whole non-negative integer; -1 when it is not one.
long long parse_non_negative(const std::string& text) {
  size_t used = 0;
  long long value = -1;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    return -1;
  }
  return used == text.size() && value >= 0 ? value : -1;
}

int64_t parse_count(const std::string& text, const std::string& spec) {
  const long long value = parse_non_negative(text);
  TORCH_CHECK_VALUE(value >= 0, "ROUNDPIPE_DEVICES='", spec, "': '", text,
                    "' is not a device number; use cuda, cuda:0,2, cuda:0x4 or cpu:N");
  return value;
}

}  // namespace

std::chrono::microseconds cpu_copy_delay_from_env() {
  const char* env = std::getenv("ROUNDPIPE_CPU_COPY_DELAY_US");
  if (env == nullptr || *env == '\0') return std::chrono::microseconds(0);
  const long long value = parse_non_negative(env);
  TORCH_CHECK_VALUE(value >= 0 && value <= 10000000, "ROUNDPIPE_CPU_COPY_DELAY_US='", env,
                    "' is not a delay in microseconds (an integer in 0..10000000)");
  return std::chrono::microseconds(value);
}

std::vector<std::string> DevicePool::parse_spec(const std::string& spec, int64_t num_cuda) {
  std::vector<std::string> out;
  if (spec == "cuda") {
    TORCH_CHECK_VALUE(num_cuda > 0, "ROUNDPIPE_DEVICES='cuda' but no CUDA device is visible; ",
                      "use cpu:N for CPU virtual devices");
    for (int64_t i = 0; i < num_cuda; ++i) out.push_back("cuda:" + std::to_string(i));
    return out;
  }
  if (spec.rfind("cpu:", 0) == 0) {
    int64_t n = parse_count(spec.substr(4), spec);
    TORCH_CHECK_VALUE(n >= 1 && n <= 256, "ROUNDPIPE_DEVICES='", spec,
                      "': the number of CPU virtual devices must be in 1..256");
    for (int64_t i = 0; i < n; ++i) out.push_back("cpu:" + std::to_string(i));
    return out;
  }
  if (spec.rfind("cuda:", 0) == 0) {
    // Items "N" or "cuda:N", each optionally "xK" for K devices over that GPU
    // (several devices over one GPU, each with its own streams: roundpipe/devices.h).
    std::stringstream list(spec.substr(5));
    std::string item;
    while (std::getline(list, item, ',')) {
      if (item.rfind("cuda:", 0) == 0) item = item.substr(5);
      int64_t copies = 1;
      const size_t x = item.find('x');
      if (x != std::string::npos) {
        copies = parse_count(item.substr(x + 1), spec);
        TORCH_CHECK_VALUE(copies >= 1 && copies <= 8, "ROUNDPIPE_DEVICES='", spec, "': '", item,
                          "' asks for ", copies, " devices over one GPU; use 1..8 (cuda:0x4)");
        item = item.substr(0, x);
      }
      int64_t i = parse_count(item, spec);
      TORCH_CHECK_VALUE(i < num_cuda, "ROUNDPIPE_DEVICES='", spec, "': cuda:", i,
                        " does not exist (", num_cuda, " CUDA devices visible)");
      for (int64_t c = 0; c < copies; ++c) out.push_back("cuda:" + std::to_string(i));
    }
    TORCH_CHECK_VALUE(!out.empty(), "ROUNDPIPE_DEVICES='", spec, "' lists no device");
    TORCH_CHECK_VALUE(out.size() <= 64, "ROUNDPIPE_DEVICES='", spec, "' lists ", out.size(),
                      " devices; at most 64 accelerator devices");
    return out;
  }
  TORCH_CHECK_VALUE(false, "ROUNDPIPE_DEVICES='", spec,
                    "' is not understood; use cuda, cuda:0,2, cuda:0x4 or cpu:N");
  return out;
}

namespace {

// The pool, made on first use, and whether it wraps its devices.
struct PoolSlot {
  std::mutex mu;
  DevicePool* pool = nullptr;  // guarded by mu
  bool wrap = false;           // guarded by mu
};

PoolSlot& pool_slot() {
  static PoolSlot slot;
  return slot;
}

}  // namespace

DevicePool& DevicePool::instance() {
  // Created on first use; if creation throws, the next call tries again.
  PoolSlot& slot = pool_slot();
  std::lock_guard<std::mutex> lock(slot.mu);
  if (slot.pool == nullptr) {
    int64_t num_cuda = at::detail::getCUDAHooks().getNumGPUs();
    const char* env = std::getenv("ROUNDPIPE_DEVICES");
    std::string spec = env != nullptr && *env != '\0' ? env : (num_cuda > 0 ? "cuda" : "cpu:1");
    // Leaked on purpose: device threads must outlive every model, including
    // ones destroyed during static destruction.
    slot.pool = new DevicePool(parse_spec(spec, num_cuda), slot.wrap);
  }
  return *slot.pool;
}

void DevicePool::wrap_devices_for_fault_injection() {
  PoolSlot& slot = pool_slot();
  std::lock_guard<std::mutex> lock(slot.mu);
  TORCH_CHECK(slot.pool == nullptr,
              "wrap_devices_for_fault_injection: the device pool exists already; call it before "
              "its first use");
  slot.wrap = true;
}

DevicePool::DevicePool(const std::vector<std::string>& specs, bool wrap_for_fault_injection) {
  const std::chrono::microseconds copy_delay = cpu_copy_delay_from_env();
  for (size_t i = 0; i < specs.size(); ++i) {
    const int index = static_cast<int>(i);
    std::unique_ptr<Device> device;
    if (specs[i].rfind("cpu:", 0) == 0) {
      device = std::make_unique<CpuDevice>(index, copy_delay);
    } else {
      device = make_accelerator_device(index, c10::Device(specs[i]));
    }
    if (wrap_for_fault_injection) device = std::make_unique<FaultInjectingDevice>(std::move(device));
    devices_.push_back(std::move(device));
  }
}

FaultInjectingDevice& DevicePool::fault_injecting_device(int64_t i) const {
  auto* wrapper = dynamic_cast<FaultInjectingDevice*>(&device(i));
  TORCH_CHECK(wrapper != nullptr, "fault_injecting_device: the device pool does not wrap its ",
              "devices (DevicePool::wrap_devices_for_fault_injection before its first use)");
  return *wrapper;
}

void DevicePool::submit_batch(const std::vector<int64_t>& devices,
                              const std::vector<std::function<void(Device&)>>& tasks) {
  TORCH_INTERNAL_ASSERT(devices.size() == tasks.size());
  std::lock_guard<std::mutex> lock(submit_mu_);
  for (size_t i = 0; i < tasks.size(); ++i) {
    Device& dev = *devices_.at(devices[i]);
    dev.submit([&dev, task = tasks[i]] { task(dev); });
  }
}

int64_t get_num_devices() { return DevicePool::instance().size(); }

std::vector<std::string> get_device_names() {
  std::vector<std::string> names;
  auto& pool = DevicePool::instance();
  for (int64_t i = 0; i < pool.size(); ++i) names.push_back(pool.device(i).name());
  return names;
}

std::vector<DeviceMemoryStats> device_memory_stats() {
  std::vector<DeviceMemoryStats> out;
  auto& pool = DevicePool::instance();
  for (int64_t i = 0; i < pool.size(); ++i) {
    Device& d = pool.device(i);
    out.push_back({d.name(), d.memory_allocated(), d.max_memory_allocated(), d.max_memory_reserved()});
  }
  return out;
}

void reset_peak_device_memory() {
  auto& pool = DevicePool::instance();
  for (int64_t i = 0; i < pool.size(); ++i) pool.device(i).reset_peak_memory();
}

}  // namespace roundpipe
