// Checkpoints inside the engine: the two phases of a load (read and check,
// then apply) for bindings that restore their own optimizer state between
// them, and opaque bytes for those bindings. The bindings reach it through
// engine_access.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/serialize/input-archive.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/checkpoint_file.h"
#include "roundpipe/checkpoint.h"
#include "roundpipe/timer.h"

namespace roundpipe {
namespace detail {

// Waits for the model's queued work, its optimizer steps included, without
// publishing the newest step into its parameters (what a save sees).
void quiesce_for_checkpoint(RoundPipe::Impl& model);

// save_checkpoint, plus `extra` bytes stored as they are (may be null).
void save_checkpoint_with(const std::string& path, RoundPipe::Impl& model,
                          const CheckpointState& state, const std::string* extra);

// A checkpoint read from its file and checked against a model, not applied.
struct PendingCheckpoint {
  std::string path;
  std::shared_ptr<RoundPipe::Impl> model;
  std::vector<std::pair<at::Tensor, at::Tensor>>
      copies;  // (model tensor, saved value), all checked
  std::vector<at::Tensor> accum, master_grad,
      optim_grad;  // [HostParam id] pending gradients or undefined
  uint64_t seed = 0;
  int64_t next_call_id = 0;
  int64_t steps_issued = 0;
  bool model_behind_optimizer = false;
  std::vector<ModelTimer::Entry> timer;
  std::unique_ptr<torch::serialize::InputArchive> optimizer;  // null when saved without one
  c10::optional<c10::Dict<std::string, c10::IValue>> scaler;  // nullopt when saved without one
  int64_t step = 0;
  std::map<std::string, int64_t> extra_state;
  std::string metadata_json;
  std::string extra;
  bool has_extra = false;

  // Writes everything into the model (cannot fail after the checks).
  void apply();
};

// Reads `path` and checks it against `model` (after waiting for the model's
// queued work). Errors as load_checkpoint's.
PendingCheckpoint read_checkpoint(const std::string& path,
                                  const std::shared_ptr<RoundPipe::Impl>& model);

}  // namespace detail
}  // namespace roundpipe
