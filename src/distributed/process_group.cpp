// ProcessGroup on c10d: its own Gloo backend (a TCP or file store to meet,
// Gloo collectives on host tensors), or a c10d process group made elsewhere.
#include "roundpipe/distributed.h"


#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <mutex>

namespace roundpipe {
namespace {

int64_t from_env(const char* name, int64_t given) {
  if (given >= 0) return given;
  const char* value = std::getenv(name);
  TORCH_CHECK_VALUE(value != nullptr && *value != '\0', "ProcessGroup: ", name,
                    " is not set; set it (the launcher's convention: RANK, WORLD_SIZE, MASTER_ADDR, "
                    "MASTER_PORT) or pass ProcessGroupOptions::", name[0] == 'R' ? "rank" : "world_size");
  char* end = nullptr;
  const long long v = std::strtoll(value, &end, 10);
  TORCH_CHECK_VALUE(end != value && *end == '\0' && v >= 0, "ProcessGroup: ", name,
                    " must be a non-negative integer, got '", value, "'");
  return v;
}

std::string env_string(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK_VALUE(value != nullptr && *value != '\0', "ProcessGroup: init_method 'env://' needs ", name,
                    " (the address and port of rank 0's store); set it or use 'tcp://HOST:PORT' or "
                    "'file:///PATH'");
  return value;
}

uint16_t parse_port(const std::string& text, const std::string& where) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  TORCH_CHECK_VALUE(!text.empty() && *end == '\0' && v > 0 && v < 65536, "ProcessGroup: ", where,
                    " must be a port number in 1..65535, got '", text, "'");
  return static_cast<uint16_t>(v);
}

// The failure's own words, without a C++ backtrace.
std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// The network interface Gloo uses: GLOO_SOCKET_IFNAME (as torch.distributed),
// loopback when the peers meet on a loopback address, else the address the
// host name resolves to.
std::shared_ptr<::gloo::transport::Device> make_device(const std::string& host) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0') {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (is_loopback(host)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

}  // namespace

class ProcessGroup::Impl {
 public:
  int64_t rank = 0;
  int64_t world_size = 1;
  std::chrono::milliseconds timeout{};
  c10::intrusive_ptr<c10d::Store> store;
  // One of the two: the Gloo backend made by create(), or a wrapped group.
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  c10::intrusive_ptr<c10d::ProcessGroup> wrapped;
  bool stage_on_cuda = false;  // the wrapped group works on CUDA tensors only (NCCL)
  std::mutex mu;          // orders the starts of collectives issued by several threads
  std::string model;      // the model served (guarded by mu)
  std::function<void()> drain;  // waits for the served model's queued steps (guarded by mu)
  std::string failure;    // the first failed collective's message (guarded by mu)

  // Before a user's collective: the served model's queued steps first.
  void wait_for_model_steps();

  void fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu);
    if (failure.empty()) failure = message;
  }

  std::string where(const std::string& what) const {
    return c10::str("data parallel: ", what, " failed on rank ", rank, " of ", world_size,
                    " (a peer process may have died, or not answered within the timeout of ",
                    static_cast<double>(timeout.count()) / 1000.0, " s): ");
  }

  // Runs fn(backend) with whichever backend this group has (both have
  // c10d's collective methods).
  template <typename Fn>
  auto on_backend(Fn&& fn) {
    return gloo ? fn(*gloo) : fn(*wrapped);
  }

  // The tensor a collective runs on: `host` itself, or its copy on the
  // current CUDA device for groups that work on CUDA tensors only.
  at::Tensor staged(const at::Tensor& host) const {
    if (!stage_on_cuda) return host;
    const c10::Device device = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
    return host.to(device, /*non_blocking=*/false, /*copy=*/true);
  }

  // What the backend is given for `staged`: its own TensorImpl over the same
  // storage, without autograd metadata. The backend's thread may drop a
  // finished work (its last reference to these) after wait() returned; it then
  // frees only objects the caller never reads. ThreadSanitizer cannot see the
  // reference counts inside libtorch that order such a free after our reads.
  static std::vector<at::Tensor> backend_tensors(const at::Tensor& staged) { return {staged.variable_data()}; }

  template <typename Start>
  auto start(const std::string& what, Start&& fn) {
    std::unique_lock<std::mutex> lock(mu);
    TORCH_CHECK(failure.empty(), "data parallel: ", what, " not started on rank ", rank,
                ": an earlier collective failed, so the processes no longer agree on the sequence of "
                "collectives (end them and resume from a checkpoint). The first failure: ", failure);
    try {
      return fn();
    } catch (const std::exception& e) {
      const std::string message = where(what) + message_of(e);
      failure = message;
      lock.unlock();
      TORCH_CHECK(false, message);
    }
  }
};

namespace {

// A collective in flight. `host` and `staged` differ when the collective
// runs on a CUDA copy: the result is copied back after the wait.
class CollectiveWork : public ProcessGroup::Work {
 public:
  CollectiveWork(c10::intrusive_ptr<c10d::Work> work, std::string context, ProcessGroup::Impl* group,
                 at::Tensor host = {}, at::Tensor staged = {})
      : work_(std::move(work)),
        context_(std::move(context)),
        group_(group),
        host_(std::move(host)),
        staged_(std::move(staged)) {}
  void wait() override {
    try {
      work_->wait();
      if (host_.defined() && !staged_.is_same(host_)) host_.copy_(staged_);
    } catch (const std::exception& e) {
      group_->fail(context_ + message_of(e));
      TORCH_CHECK(false, context_, message_of(e));
    }
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string context_;
  ProcessGroup::Impl* group_;  // outlives its collectives' waits (held by the caller)
  at::Tensor host_, staged_;
};

void check_collective_tensor(const at::Tensor& t, const std::string& what) {
  TORCH_CHECK_VALUE(t.defined() && t.device().is_cpu() && t.is_contiguous(), "ProcessGroup: ", what,
                    ": the tensor must be a defined, contiguous CPU tensor");
}

}  // namespace

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::create(ProcessGroupOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->rank = from_env("RANK", options.rank);
  impl->world_size = from_env("WORLD_SIZE", options.world_size);
  TORCH_CHECK_VALUE(impl->world_size >= 1, "ProcessGroup: world_size must be >= 1, got ", impl->world_size);
  TORCH_CHECK_VALUE(impl->rank < impl->world_size, "ProcessGroup: rank must be in 0..", impl->world_size - 1,
                    " (world_size ", impl->world_size, "), got ", impl->rank);
  TORCH_CHECK_VALUE(options.timeout.count() > 0, "ProcessGroup: timeout must be positive, got ",
                    options.timeout.count(), " ms");
  impl->timeout = options.timeout;
  const std::string& method = options.init_method;
  std::string host;
  if (method == "env://" || method.rfind("tcp://", 0) == 0) {
    uint16_t port = 0;
    if (method == "env://") {
      host = env_string("MASTER_ADDR");
      port = parse_port(env_string("MASTER_PORT"), "MASTER_PORT");
    } else {
      const std::string rest = method.substr(6);
      const size_t colon = rest.rfind(':');
      TORCH_CHECK_VALUE(colon != std::string::npos && colon > 0, "ProcessGroup: init_method '", method,
                        "' must be tcp://HOST:PORT");
      host = rest.substr(0, colon);
      port = parse_port(rest.substr(colon + 1), "the port of init_method '" + method + "'");
    }
    // Under torchrun's elastic agent the agent already hosts the store at
    // MASTER_ADDR:MASTER_PORT (as torch.distributed, join it as a client).
    const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    const bool use_agent_store = agent_store != nullptr && std::string(agent_store) == "True";
    c10d::TCPStoreOptions store_options;
    store_options.port = port;
    store_options.isServer = impl->rank == 0 && !use_agent_store;
    store_options.numWorkers = static_cast<size_t>(impl->world_size);
    store_options.waitWorkers = !use_agent_store;  // every process counts itself in at the store
    store_options.timeout = options.timeout;
    try {
      impl->store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
      if (use_agent_store) {  // torch.distributed's key space in the agent's store
        const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
        impl->store = c10::make_intrusive<c10d::PrefixStore>(
            std::string("/worker/attempt_") + (attempt != nullptr ? attempt : "0") + "/roundpipe", impl->store);
      }
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "ProcessGroup: rank ", impl->rank, " could not meet the other ", impl->world_size - 1,
                  " processes at ", host, ":", port, " within ", options.timeout.count(), " ms: ", message_of(e));
    }
  } else if (method.rfind("file://", 0) == 0) {
    const std::string path = method.substr(7);
    TORCH_CHECK_VALUE(!path.empty() && path.front() == '/', "ProcessGroup: init_method '", method,
                      "' must be file:///ABSOLUTE/PATH");
    impl->store = c10::make_intrusive<c10d::FileStore>(path, static_cast<int>(impl->world_size));
    impl->store->setTimeout(options.timeout);
    host = "127.0.0.1";
    if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr != '\0') host = addr;
  } else {
    TORCH_CHECK_VALUE(false, "ProcessGroup: init_method must be 'env://', 'tcp://HOST:PORT' or "
                      "'file:///PATH', got '", method, "'");
  }
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  gloo_options->devices.push_back(make_device(host));
  gloo_options->threads = 2;
  try {
    impl->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, static_cast<int>(impl->rank),
                                                             static_cast<int>(impl->world_size), gloo_options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "ProcessGroup: rank ", impl->rank, " could not connect to its ", impl->world_size - 1,
                " peers within ", options.timeout.count(), " ms: ", message_of(e));
  }
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

std::shared_ptr<ProcessGroup> ProcessGroup::wrap(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                 std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(group, "ProcessGroup::wrap: the c10d process group is null");
  TORCH_CHECK_VALUE(timeout.count() > 0, "ProcessGroup::wrap: timeout must be positive, got ", timeout.count(),
                    " ms");
  auto impl = std::make_unique<Impl>();
  impl->rank = group->getRank();
  impl->world_size = group->getSize();
  impl->timeout = timeout;
  impl->stage_on_cuda = group->getBackendName().find("nccl") != std::string::npos;
  impl->wrapped = std::move(group);
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

int64_t ProcessGroup::rank() const { return impl_->rank; }
int64_t ProcessGroup::world_size() const { return impl_->world_size; }
std::chrono::milliseconds ProcessGroup::timeout() const { return impl_->timeout; }

std::unique_ptr<ProcessGroup::Work> ProcessGroup::start_all_reduce_sum(at::Tensor tensor, std::string what) {
  check_collective_tensor(tensor, what);
  at::Tensor staged = impl_->staged(tensor);
  std::vector<at::Tensor> tensors = Impl::backend_tensors(staged);
  auto work = impl_->start(what, [&] {
    return impl_->on_backend([&](auto& backend) { return backend.allreduce(tensors, c10d::AllreduceOptions()); });
  });
  return std::make_unique<CollectiveWork>(std::move(work), impl_->where(what), impl_.get(), std::move(tensor),
                                          std::move(staged));
}

void ProcessGroup::Impl::wait_for_model_steps() {
  std::function<void()> fn;
  {
    std::lock_guard<std::mutex> lock(mu);
    fn = drain;
  }
  if (fn) fn();
}

void ProcessGroup::all_reduce_sum(at::Tensor tensor, const std::string& what) {
  impl_->wait_for_model_steps();
  start_all_reduce_sum(std::move(tensor), what)->wait();
}

void ProcessGroup::broadcast(at::Tensor tensor, int64_t root, const std::string& what) {
  check_collective_tensor(tensor, what);
  TORCH_CHECK_VALUE(root >= 0 && root < impl_->world_size, "ProcessGroup: broadcast root must be in 0..",
                    impl_->world_size - 1, ", got ", root);
  impl_->wait_for_model_steps();
  at::Tensor staged = impl_->staged(tensor);
  std::vector<at::Tensor> tensors = Impl::backend_tensors(staged);
  c10d::BroadcastOptions options;
  options.rootRank = root;
  auto work = impl_->start(what, [&] {
    return impl_->on_backend([&](auto& backend) { return backend.broadcast(tensors, options); });
  });
  CollectiveWork(std::move(work), impl_->where(what), impl_.get(), tensor, staged).wait();
}

void ProcessGroup::barrier(const std::string& what) {
  impl_->wait_for_model_steps();
  auto work = impl_->start(what, [&] {
    return impl_->on_backend([&](auto& backend) { return backend.barrier(c10d::BarrierOptions()); });
  });
  CollectiveWork(std::move(work), impl_->where(what), impl_.get()).wait();
}

namespace detail {

void attach_model(ProcessGroup& group, const std::string& model_name, std::function<void()> drain) {
  std::lock_guard<std::mutex> lock(group.impl_->mu);
  TORCH_CHECK_VALUE(group.impl_->model.empty(), "RoundPipe '", model_name,
                    "': its process group already serves model '", group.impl_->model,
                    "'; create one ProcessGroup per model (collectives of two models would interleave "
                    "differently on each process)");
  group.impl_->model = model_name;
  group.impl_->drain = std::move(drain);
}

void detach_model(ProcessGroup& group) {
  std::lock_guard<std::mutex> lock(group.impl_->mu);
  group.impl_->model.clear();
  group.impl_->drain = nullptr;
}

}  // namespace detail

bool distributed_available() { return true; }

}  // namespace roundpipe
