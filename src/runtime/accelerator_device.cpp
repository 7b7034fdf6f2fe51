// Accelerator backend written against c10's device-generic stream, event and
// guard API, so it builds against CPU-only and CUDA libtorch alike.
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/cuda_memory.h"
#include "runtime/device.h"
#include "runtime/download_batch.h"

namespace roundpipe {
namespace {

// Events are reused: creating and destroying one per copy (or two per
// layer computation, for its time) costs more than the copy of a small
// tensor. One pool per kind: fences (no timing) and time marks.
class EventPool {
 public:
  EventPool(c10::DeviceType type, c10::EventFlag flag) : type_(type), flag_(flag) {}
  std::unique_ptr<c10::Event> take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return std::make_unique<c10::Event>(type_, flag_);
    std::unique_ptr<c10::Event> event = std::move(free_.back());
    free_.pop_back();
    return event;
  }
  void give_back(std::unique_ptr<c10::Event> event) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(event));
  }

 private:
  c10::DeviceType type_;
  c10::EventFlag flag_;
  std::mutex mu_;
  std::vector<std::unique_ptr<c10::Event>> free_;
};

// Waits on the host until `event` has completed, sleeping between queries
// (2 us at first, doubling up to 100 us) rather than in
// cudaEventSynchronize, which under CUDA's default scheduling spins a core
// for the whole wait: device workers wait like this for most of a job, and
// the optimizer steps on those cores.
void wait_for(const c10::Event& event) {
  auto pause = std::chrono::microseconds(2);
  while (!event.query()) {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(100));
  }
}

// An event of `pool` recorded on `stream`, given back to the pool when it goes.
class PooledEvent {
 public:
  PooledEvent(std::shared_ptr<EventPool> pool, const c10::Stream& stream)
      : pool_(std::move(pool)), event_(pool_->take()) {
    event_->record(stream);
  }
  ~PooledEvent() { pool_->give_back(std::move(event_)); }
  PooledEvent(const PooledEvent&) = delete;
  PooledEvent& operator=(const PooledEvent&) = delete;
  const c10::Event& operator*() const { return *event_; }
  const c10::Event* operator->() const { return event_.get(); }

 private:
  std::shared_ptr<EventPool> pool_;
  std::unique_ptr<c10::Event> event_;
};

class EventFence final : public Fence {
 public:
  EventFence(std::shared_ptr<EventPool> pool, const c10::Stream& stream) : event_(std::move(pool), stream) {}
  void synchronize() const override { wait_for(*event_); }
  bool query() const override { return event_->query(); }
  void block(const c10::Stream& stream) const { event_->block(stream); }

 private:
  PooledEvent event_;
};

// A timing event recorded on a lane's stream: device time between two marks.
class EventMark final : public TimeMark {
 public:
  EventMark(std::shared_ptr<EventPool> pool, const c10::Stream& stream)
      : TimeMark(host_now_ms()), event_(std::move(pool), stream) {}
  double ms_since(const TimeMark& earlier) const override {
    if (auto* e = dynamic_cast<const EventMark*>(&earlier)) {
      wait_for(*e->event_);
      wait_for(*event_);
      return e->event_->elapsedTime(*event_);
    }
    return TimeMark::ms_since(earlier);
  }

 private:
  PooledEvent event_;
};

class AcceleratorDevice final : public Device {
 public:
  AcceleratorDevice(int pool_index, c10::Device device)
      : Device(pool_index, device.str()),
        device_(device),
        events_(std::make_shared<EventPool>(device.type(), c10::EventFlag::PYTORCH_DEFAULT)),
        timing_events_(std::make_shared<EventPool>(device.type(), c10::EventFlag::BACKEND_DEFAULT)) {
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

  std::vector<at::Tensor> upload(const std::vector<at::Tensor>& host, Lane lane, const FencePtr& after) override {
    const c10::Stream& stream = streams_[static_cast<int>(lane)];
    if (after) wait_on(after, stream);
    c10::StreamGuard guard(stream);
    at::NoGradGuard no_grad;  // copies, not steps of the caller's graph
    const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
    std::vector<at::Tensor> out(host.size());
    for (size_t i = 0; i < host.size(); ++i) {
      if (!host[i].defined()) continue;
      out[i] = host[i].to(device_, /*non_blocking=*/true, /*copy=*/true);
      // Allocated on `stream`, used on the compute stream: the allocator
      // must not reuse it before the compute stream is done with it.
      impl->recordDataPtrOnStream(out[i].storage().data_ptr(), compute_stream());
      // A caller's input on an accelerator, read here on `stream`: its
      // memory must outlive this copy however soon the caller frees it.
      if (host[i].device().type() == device_.type()) {
        impl->recordDataPtrOnStream(host[i].storage().data_ptr(), stream);
      }
    }
    return out;
  }

  std::vector<at::Tensor> download(const std::vector<at::Tensor>& device_tensors) override {
    const c10::Stream& stream = streams_[static_cast<int>(Lane::kDownload)];
    EventFence(events_, compute_stream()).block(stream);  // one wait for the whole batch
    c10::StreamGuard guard(stream);
    at::NoGradGuard no_grad;
    const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
    // Recorded first: a copy issued before a later one fails still reads them.
    for (const at::Tensor& t : device_tensors) {
      if (t.defined() && t.layout() == at::kStrided) impl->recordDataPtrOnStream(t.storage().data_ptr(), stream);
    }
    DownloadBatch batch = plan_download(device_tensors, /*pinned=*/true);
    for (const DownloadBatch::Run& run : batch.runs) {
      if (run.members.size() == 1) {
        batch.host[run.members[0]].copy_(device_tensors[run.members[0]], /*non_blocking=*/true);
        continue;
      }
      // One gather kernel and one copy. The gathered tensor is made and
      // freed on this stream, so the allocator reuses it only after the copy.
      std::vector<at::Tensor> flat;
      for (size_t i : run.members) flat.push_back(device_tensors[i].reshape({-1}));
      run.into.copy_(at::cat(flat), /*non_blocking=*/true);
    }
    return std::move(batch.host);
  }

  FencePtr lane_fence(Lane lane) override {
    return std::make_shared<EventFence>(events_, streams_[static_cast<int>(lane)]);
  }
  void compute_wait(const FencePtr& fence) override {
    if (fence) wait_on(fence, compute_stream());
  }
  void synchronize() override {
    for (const auto& stream : streams_) stream.synchronize();
  }
  MarkPtr mark(Lane lane) override {
    return std::make_shared<EventMark>(timing_events_, streams_[static_cast<int>(lane)]);
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
  std::shared_ptr<EventPool> events_;         // fences
  std::shared_ptr<EventPool> timing_events_;  // time marks
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
