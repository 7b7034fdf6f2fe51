// ProcessGroup in a build without c10d's Gloo backend: creating one fails
// with the way out; nothing else can be reached without a group.
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "roundpipe/distributed.h"

namespace roundpipe {

class ProcessGroup::Impl {};

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::create(ProcessGroupOptions) {
  TORCH_CHECK(false, "ProcessGroup: this build of roundpipe has no c10d Gloo backend (the Gloo headers were not "
              "found when it was configured); install them (Debian: libgloo-dev) and rebuild");
}

std::shared_ptr<ProcessGroup> ProcessGroup::wrap(c10::intrusive_ptr<c10d::ProcessGroup>, std::chrono::milliseconds) {
  TORCH_CHECK(false, "ProcessGroup::wrap: this build of roundpipe has no c10d support (the Gloo headers were not "
              "found when it was configured); install them (Debian: libgloo-dev) and rebuild");
}

int64_t ProcessGroup::rank() const { return 0; }
int64_t ProcessGroup::world_size() const { return 1; }
std::chrono::milliseconds ProcessGroup::timeout() const { return {}; }
std::unique_ptr<ProcessGroup::Work> ProcessGroup::start_all_reduce_sum(at::Tensor, std::string) { return nullptr; }
void ProcessGroup::all_reduce_sum(at::Tensor, const std::string&) {}
void ProcessGroup::broadcast(at::Tensor, int64_t, const std::string&) {}
void ProcessGroup::barrier(const std::string&) {}

namespace detail {
void attach_model(ProcessGroup&, const std::string&, std::function<void()>) {}
void detach_model(ProcessGroup&) {}
}  // namespace detail

bool distributed_available() { return false; }

}  // namespace roundpipe
