// Accelerator backend written against c10's device-generic stream, event and
// guard API, so it builds against CPU-only and CUDA libtorch alike.
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/COW.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "runtime/copy_lane.h"
#include "runtime/cuda_memory.h"
#include "runtime/device.h"
#include "runtime/download_batch.h"
#include "runtime/host_block_pool.h"

namespace roundpipe {
namespace {

// Tells the caching allocator that `stream` uses `t`'s memory, so it is not
// reused before the stream's work on it. CUDA's records streams only on a
// DataPtr it made, not on a copy-on-write one (a layer's buffer watched for
// writes, docs/design/engine.md "Iteration overlap"): such a storage first
// becomes an ordinary one. It is the watched tensor's only owner, so that
// takes its memory over without a copy.
void record_on(const c10::impl::DeviceGuardImplInterface* impl, const at::Tensor& t,
               const c10::Stream& stream) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (c10::impl::cow::is_cow_data_ptr(storage->data_ptr())) {
    c10::impl::cow::materialize_cow_storage(*storage);
  }
  impl->recordDataPtrOnStream(storage->data_ptr(), stream);
}

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
// the optimizer steps on those cores. The thread's timer slack is cut to
// 1 us first: with Linux's default of 50 us, each short sleep lasts 50 us.
void wait_for(const c10::Event& event) {
#ifdef __linux__
  thread_local const bool slack_set = prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0) == 0;
  (void)slack_set;
#endif
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

// A fence a stream can wait for without blocking the host (when its work has
// been issued).
class StreamFence : public Fence {
 public:
  virtual void block(const c10::Stream& stream) const = 0;
};

class EventFence final : public StreamFence {
 public:
  EventFence(std::shared_ptr<EventPool> pool, const c10::Stream& stream) : event_(std::move(pool), stream) {}
  void synchronize() const override { wait_for(*event_); }
  bool query() const override { return event_->query(); }
  void block(const c10::Stream& stream) const override { event_->block(stream); }

 private:
  PooledEvent event_;
};

// What a thread issuing a lane's work records when it gets to a point of it
// (see IssuingLane): `issued` completes then, and `recorded` holds it.
template <typename T>
struct Issued {
  FencePtr issued;
  std::shared_ptr<std::shared_ptr<const T>> recorded;
  // The recorded value, once issued (rethrows the issuing thread's error).
  const T& get() const {
    issued->synchronize();
    TORCH_INTERNAL_ASSERT(*recorded, "an issued point of a lane was not recorded");
    return **recorded;
  }
};

// A fence of the parameter-upload lane: the event its issuing thread records.
class IssuedFence final : public StreamFence {
 public:
  explicit IssuedFence(Issued<EventFence> point) : point_(std::move(point)) {}
  void synchronize() const override { point_.get().synchronize(); }
  bool query() const override { return point_.issued->query() && *point_.recorded && (*point_.recorded)->query(); }
  // The host waits until the event is recorded (a stream cannot wait for an
  // event not yet recorded), then the stream for the event.
  void block(const c10::Stream& stream) const override { point_.get().block(stream); }

 private:
  Issued<EventFence> point_;
};

// Relates a device's event times to the host clock: an event recorded on a
// stream with no other work completes as soon as the device sees it, within
// microseconds of `host_ms`, when the host issued it.
struct ClockAnchor {
  ClockAnchor(std::shared_ptr<EventPool> pool, const c10::Stream& idle)
      : host_ms(host_now_ms()), event(std::move(pool), idle) {}
  double host_ms;
  PooledEvent event;
};

// A timing event recorded on a lane's stream: device time between two marks,
// placed on the host clock through the device's clock anchor.
class EventMark final : public TimeMark {
 public:
  EventMark(std::shared_ptr<EventPool> pool, const c10::Stream& stream, std::shared_ptr<const ClockAnchor> anchor)
      : TimeMark(0), event_(std::move(pool), stream), anchor_(std::move(anchor)) {}
  double ms_since(const TimeMark& earlier) const override;
  double host_ms() const override {
    wait_for(*event_);
    wait_for(*anchor_->event);
    return anchor_->host_ms + anchor_->event->elapsedTime(*event_);
  }
  const c10::Event& event() const {
    wait_for(*event_);
    return *event_;
  }

 private:
  PooledEvent event_;
  std::shared_ptr<const ClockAnchor> anchor_;
};

// A mark of the parameter-upload lane, recorded by its issuing thread.
class IssuedMark final : public TimeMark {
 public:
  explicit IssuedMark(Issued<EventMark> point) : TimeMark(0), point_(std::move(point)) {}
  double ms_since(const TimeMark& earlier) const override { return point_.get().ms_since(earlier); }
  double host_ms() const override { return point_.get().host_ms(); }
  const EventMark& mark() const { return point_.get(); }

 private:
  Issued<EventMark> point_;
};

double EventMark::ms_since(const TimeMark& earlier) const {
  const EventMark* e = dynamic_cast<const EventMark*>(&earlier);
  if (auto* issued = dynamic_cast<const IssuedMark*>(&earlier)) e = &issued->mark();
  if (e == nullptr) return TimeMark::ms_since(earlier);
  return e->event().elapsedTime(event());
}

// Keeps tensors alive until the copies that read or write them have
// completed, as a CPU device's copy lanes do (device.h): host memory a copy
// uses (a page-locked block, a staged input) is not reused before its fence.
class HeldUntilCopied {
 public:
  void hold(FencePtr fence, std::vector<at::Tensor> tensors) {
    std::lock_guard<std::mutex> lock(mu_);
    held_.emplace_back(std::move(fence), std::move(tensors));
    release_completed_locked();
  }
  void release_completed() {
    std::lock_guard<std::mutex> lock(mu_);
    release_completed_locked();
  }

 private:
  void release_completed_locked() {
    while (!held_.empty() && held_.front().first->query()) held_.pop_front();
  }
  std::mutex mu_;
  std::deque<std::pair<FencePtr, std::vector<at::Tensor>>> held_;  // issue order
};

// The page-locked host blocks downloads go to (see host_block_pool.h). One
// for the process; never destroyed, a model may outlive static destruction.
HostBlockPool& page_locked_pool() {
  static auto* pool = new HostBlockPool([](int64_t bytes) { return cuda::page_locked_bytes(bytes); });
  return *pool;
}

class AcceleratorDevice final : public Device {
 public:
  AcceleratorDevice(int pool_index, c10::Device device)
      : Device(pool_index, device.str()),
        device_(device),
        events_(std::make_shared<EventPool>(device.type(), c10::EventFlag::PYTORCH_DEFAULT)),
        timing_events_(std::make_shared<EventPool>(device.type(), c10::EventFlag::BACKEND_DEFAULT)),
        param_issuer_("the parameter upload lane of " + device.str(), std::chrono::microseconds(0)) {
    const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
    for (auto& stream : streams_) stream = impl->getStreamFromGlobalPool(device);
    clock_stream_ = impl->getStreamFromGlobalPool(device, /*isHighPriority=*/true);
    start_worker();
  }
  ~AcceleratorDevice() override {
    stop_worker();
    // Nothing issued may still use what goes with the device (the held host
    // blocks go back to a pool shared by all devices). Each wait on its own:
    // the driver may be shutting down at exit.
    try {
      param_issuer_.synchronize();
    } catch (...) {
    }
    for (const auto& stream : streams_) {
      try {
        stream.synchronize();
      } catch (...) {
      }
    }
  }

  c10::Device torch_device() const override { return device_; }
  // The caching allocator's statistics (CUDA); other backends are not
  // measured (0).
  int64_t memory_allocated() const override {
    return is_cuda() ? cuda::allocated_bytes(device_.index()) : 0;
  }
  int64_t max_memory_allocated() const override {
    return is_cuda() ? cuda::peak_allocated_bytes(device_.index()) : 0;
  }
  int64_t max_memory_reserved() const override {
    return is_cuda() ? cuda::peak_reserved_bytes(device_.index()) : 0;
  }
  void reset_peak_memory() override {
    if (is_cuda()) cuda::reset_peak_allocated_bytes(device_.index());
  }

  // Device memory is allocated on the stream that writes it: a block the
  // caching allocator hands out on the compute stream may still be in use by
  // compute queued there, which the copy's stream is not ordered after. The
  // compute stream, which uses it, is recorded on it. (Each stream's blocks
  // are kept apart; the stage slots bound what the upload streams hold.)
  std::vector<at::Tensor> upload(const std::vector<at::Tensor>& host, Lane lane, const FencePtr& after) override {
    held_.release_completed();
    const c10::Stream& stream = streams_[static_cast<int>(lane)];
    const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
    std::vector<at::Tensor> out(host.size()), sources(host.size());
    c10::StreamGuard allocate_on(stream);
    for (size_t i = 0; i < host.size(); ++i) {
      if (!host[i].defined()) continue;
      out[i] = at::empty(host[i].sizes(), host[i].options().device(device_).memory_format(at::MemoryFormat::Contiguous));
      impl->recordDataPtrOnStream(out[i].storage().data_ptr(), compute_stream());
      sources[i] = host[i].detach();  // its own handle: the caller may set_data on its tensor
      // A caller's input on an accelerator, read here on `stream`: its
      // memory must outlive this copy however soon the caller frees it.
      if (host[i].device().type() == device_.type()) record_on(impl, host[i], stream);
    }
    dirty_[static_cast<int>(lane)] = true;
    if (lane == Lane::kParamUpload) {
      param_issuer_.issue_after(after, [this, out, sources] { copy_in(Lane::kParamUpload, out, sources); });
    } else {
      if (after) wait_on(after, stream);
      copy_in(lane, out, sources);
    }
    return out;
  }

  std::vector<at::Tensor> download(const std::vector<at::Tensor>& device_tensors) override {
    held_.release_completed();
    const c10::Stream& stream = streams_[static_cast<int>(Lane::kDownload)];
    EventFence(events_, compute_stream()).block(stream);  // one wait for the whole batch
    // Everything below runs on the download stream: the gathers, and the
    // temporaries a reshape or a peer copy makes, belong to it.
    c10::StreamGuard guard(stream);
    at::NoGradGuard no_grad;
    const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
    // Recorded first: a copy issued before a later one fails still reads them.
    for (const at::Tensor& t : device_tensors) {
      if (t.defined() && t.layout() == at::kStrided) record_on(impl, t, stream);
    }
    // A tensor on another accelerator is brought here first: copied on its
    // own device's stream, a download would complete outside this lane's
    // fence. (A copy between devices waits for both devices' current streams.)
    std::vector<at::Tensor> sources = device_tensors;
    for (at::Tensor& t : sources) {
      if (t.defined() && t.device().type() == device_.type() && t.device() != device_) {
        t = t.to(device_);
        record_on(impl, t, stream);
      }
    }
    DownloadBatch batch = plan_download(sources, [](int64_t bytes) { return page_locked_pool().take(bytes); });
    std::vector<at::Tensor> used;  // host memory the copies write
    for (const DownloadBatch::Run& run : batch.runs) {
      if (run.members.size() == 1) {
        batch.host[run.members[0]].copy_(sources[run.members[0]], /*non_blocking=*/true);
        used.push_back(batch.host[run.members[0]]);
        continue;
      }
      // One gather kernel and one copy. The gathered tensor is made and
      // freed on this stream, so the allocator reuses it only after the copy.
      std::vector<at::Tensor> flat;
      for (size_t i : run.members) flat.push_back(sources[i].reshape({-1}));
      run.into.copy_(at::cat(flat), /*non_blocking=*/true);
      used.push_back(run.into);
    }
    dirty_[static_cast<int>(Lane::kDownload)] = true;
    held_.hold(lane_fence(Lane::kDownload), std::move(used));
    return std::move(batch.host);
  }

  void lane_wait(Lane lane, const FencePtr& fence) override {
    if (!fence) return;
    if (lane == Lane::kParamUpload) {
      param_issuer_.issue_after(fence, [] {});  // the issuing thread waits
    } else {
      wait_on(fence, streams_[static_cast<int>(lane)]);
    }
    dirty_[static_cast<int>(lane)] = true;
  }

  // A lane with no work since its last fence gives that fence again: a job's
  // give-back takes a fence of every lane, most of them idle.
  FencePtr lane_fence(Lane lane) override {
    const int l = static_cast<int>(lane);
    if (lane != Lane::kCompute && !dirty_[l] && last_fence_[l]) return last_fence_[l];
    if (lane == Lane::kParamUpload) {
      last_fence_[l] = std::make_shared<IssuedFence>(issue_point<EventFence>([this] {
        return std::make_shared<EventFence>(events_, streams_[static_cast<int>(Lane::kParamUpload)]);
      }));
    } else {
      last_fence_[l] = std::make_shared<EventFence>(events_, streams_[l]);
    }
    dirty_[l] = false;
    return last_fence_[l];
  }
  void compute_wait(const FencePtr& fence) override {
    if (fence) wait_on(fence, compute_stream());
  }
  void synchronize() override {
    param_issuer_.synchronize();
    for (const auto& stream : streams_) stream.synchronize();
    held_.release_completed();
  }
  MarkPtr mark(Lane lane) override {
    if (lane == Lane::kParamUpload) {
      return std::make_shared<IssuedMark>(issue_point<EventMark>([this] {
        return std::make_shared<EventMark>(timing_events_, streams_[static_cast<int>(Lane::kParamUpload)],
                                           clock_anchor());
      }));
    }
    return std::make_shared<EventMark>(timing_events_, streams_[static_cast<int>(lane)], clock_anchor());
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
    if (auto* waitable = dynamic_cast<const StreamFence*>(fence.get())) {
      waitable->block(stream);
    } else {
      fence->synchronize();
    }
  }

  // Copies `sources` into `out` on `lane`'s stream (on the worker, or on the
  // parameter lane's issuing thread). Pageable host memory is first staged
  // in page-locked memory: an asynchronous copy from pageable memory makes
  // the driver wait for the stream's earlier work, a whole stage's upload.
  void copy_in(Lane lane, const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& sources) {
    const c10::Stream& stream = streams_[static_cast<int>(lane)];
    c10::StreamGuard guard(stream);
    at::NoGradGuard no_grad;  // copies, not steps of the caller's graph
    std::vector<at::Tensor> used;
    for (size_t i = 0; i < sources.size(); ++i) {
      if (!sources[i].defined()) continue;
      at::Tensor source = sources[i];
      if (source.is_cpu() && !source.is_pinned()) source = source.pin_memory();
      out[i].copy_(source, /*non_blocking=*/true);
      if (source.is_cpu()) used.push_back(source);
    }
    if (!used.empty()) held_.hold(std::make_shared<EventFence>(events_, stream), std::move(used));
  }

  // Records `make()` where the parameter lane's issuing thread is now, once
  // it gets there.
  template <typename T>
  Issued<T> issue_point(std::function<std::shared_ptr<const T>()> make) {
    Issued<T> point;
    point.recorded = std::make_shared<std::shared_ptr<const T>>();
    param_issuer_.issue([recorded = point.recorded, make = std::move(make)] { *recorded = make(); });
    point.issued = param_issuer_.fence();
    return point;
  }

  // The clock anchor of marks recorded now: renewed every second, so that
  // a mark is at most a second of device time from its anchor (event times
  // are floats of milliseconds; the two clocks drift apart slowly).
  std::shared_ptr<const ClockAnchor> clock_anchor() {
    std::lock_guard<std::mutex> lock(anchor_mu_);
    if (!anchor_ || host_now_ms() - anchor_->host_ms > 1000.0) {
      anchor_ = std::make_shared<const ClockAnchor>(timing_events_, clock_stream_);
    }
    return anchor_;
  }

  c10::Device device_;
  std::shared_ptr<EventPool> events_;         // fences
  std::shared_ptr<EventPool> timing_events_;  // time marks
  std::array<c10::Stream, 4> streams_{
      {c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)),
       c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)),
       c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)),
       c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU))}};
  // Carries only clock anchors (a stream of the high-priority pool, apart
  // from the lanes' streams).
  c10::Stream clock_stream_{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
  HeldUntilCopied held_;  // before the issuing thread, whose copies hold tensors in it
  // Issues the parameter-upload lane's work in order: an upload gated on the
  // optimizer (a host condition) waits there, not on the worker, which goes
  // on queueing compute. Runs a copy at once, on the worker, when the lane is
  // idle and its gate open.
  CopyLane param_issuer_;
  std::mutex anchor_mu_;  // marks are also taken on the autograd thread
  std::shared_ptr<const ClockAnchor> anchor_;
  // Worker thread only: work was submitted on the lane since its last fence.
  std::array<bool, 4> dirty_{{true, true, true, true}};
  std::array<FencePtr, 4> last_fence_;
};

}  // namespace

std::unique_ptr<Device> make_accelerator_device(int pool_index, c10::Device device) {
  TORCH_CHECK(device.type() != c10::DeviceType::CPU && device.has_index(),
              "make_accelerator_device needs an indexed accelerator device, got ", device);
  return std::make_unique<AcceleratorDevice>(pool_index, device);
}

}  // namespace roundpipe
