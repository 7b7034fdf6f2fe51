// Accelerator backend written against c10's device-generic stream, event and
// guard API, so it builds against CPU-only and CUDA libtorch alike.
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <atomic>

#include "runtime/cuda_memory.h"
#include "runtime/device.h"

namespace roundpipe {
namespace {

class EventFence final : public Fence {
 public:
  EventFence(const c10::Stream& stream)
      : event_(stream.device_type(), c10::EventFlag::PYTORCH_DEFAULT) {
    event_.record(stream);
  }
  void synchronize() const override { event_.synchronize(); }
  void block(const c10::Stream& stream) const { event_.block(stream); }

 private:
  c10::Event event_;
};

// A timing event recorded on a lane's stream: device time between two marks.
class EventMark final : public TimeMark {
 public:
  explicit EventMark(const c10::Stream& stream)
      : TimeMark(host_now_ms()), event_(stream.device_type(), c10::EventFlag::BACKEND_DEFAULT) {
    event_.record(stream);
  }
  double ms_since(const TimeMark& earlier) const override {
    if (auto* e = dynamic_cast<const EventMark*>(&earlier)) {
      e->event_.synchronize();
      event_.synchronize();
      return e->event_.elapsedTime(event_);
    }
    return TimeMark::ms_since(earlier);
  }

 private:
  c10::Event event_;
};

class AcceleratorDevice final : public Device {
 public:
  AcceleratorDevice(int pool_index, c10::Device device)
      : Device(pool_index, device.str()), device_(device) {
    const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
    for (auto& stream : streams_) stream = impl->getStreamFromGlobalPool(device);
    start_worker();
  }
  ~AcceleratorDevice() override { stop_worker(); }

  c10::Device torch_device() const override { return device_; }
  // The caching allocator's statistics (CUDA); other backends are not
  // measured (0).
  int64_t memory_allocated() const override {
    return is_cuda() ? cuda::allocated_bytes(device_.index()) : 0;
  }
  int64_t max_memory_allocated() const override {
    return is_cuda() ? cuda::peak_allocated_bytes(device_.index()) : 0;
  }
  void reset_peak_memory() override {
    if (is_cuda()) cuda::reset_peak_allocated_bytes(device_.index());
  }

  at::Tensor upload(const at::Tensor& host, Lane lane, const FencePtr& after) override {
    const c10::Stream& stream = streams_[static_cast<int>(lane)];
    if (after) wait_on(after, stream);
    c10::StreamGuard guard(stream);
    at::Tensor out = host.to(device_, /*non_blocking=*/true, /*copy=*/true);
    // The tensor is allocated on `stream` but used on the compute stream.
    c10::impl::getDeviceGuardImpl(device_.type())
        ->recordDataPtrOnStream(out.storage().data_ptr(), compute_stream());
    // Compute that follows must see the copy.
    EventFence(stream).block(compute_stream());
    return out;
  }

  at::Tensor download(const at::Tensor& device_tensor, FencePtr* fence_out) override {
    const c10::Stream& stream = streams_[static_cast<int>(Lane::kDownload)];
    EventFence(compute_stream()).block(stream);
    at::Tensor host;
    {
      c10::StreamGuard guard(stream);
      host = at::empty(device_tensor.sizes(),
                       device_tensor.options().device(c10::kCPU).pinned_memory(true));
      host.copy_(device_tensor, /*non_blocking=*/true);
      c10::impl::getDeviceGuardImpl(device_.type())
          ->recordDataPtrOnStream(device_tensor.storage().data_ptr(), stream);
    }
    auto fence = std::make_shared<EventFence>(stream);
    if (fence_out) {
      *fence_out = fence;
    } else {
      fence->synchronize();
    }
    return host;
  }

  void compute_wait(const FencePtr& fence) override {
    if (fence) wait_on(fence, compute_stream());
  }
  FencePtr compute_fence() override { return std::make_shared<EventFence>(compute_stream()); }
  void synchronize() override {
    for (const auto& stream : streams_) stream.synchronize();
  }
  MarkPtr mark(Lane lane) override {
    return std::make_shared<EventMark>(streams_[static_cast<int>(lane)]);
  }

 protected:
  void run_task(const std::function<void()>& task) override {
    c10::StreamGuard guard(compute_stream());
    task();
  }

 private:
  const c10::Stream& compute_stream() const { return streams_[static_cast<int>(Lane::kCompute)]; }
  bool is_cuda() const { return device_.is_cuda() && cuda::built_with_cuda(); }
  static void wait_on(const FencePtr& fence, const c10::Stream& stream) {
    if (auto* event = dynamic_cast<const EventFence*>(fence.get())) {
      event->block(stream);
    } else {
      fence->synchronize();
    }
  }

  c10::Device device_;
  std::array<c10::Stream, 4> streams_{
      {c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)),
       c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)),
       c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)),
       c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU))}};
};

}  // namespace

std::unique_ptr<Device> make_accelerator_device(int pool_index, c10::Device device) {
  TORCH_CHECK(device.type() != c10::DeviceType::CPU && device.has_index(),
              "make_accelerator_device needs an indexed accelerator device, got ", device);
  return std::make_unique<AcceleratorDevice>(pool_index, device);
}

}  // namespace roundpipe
