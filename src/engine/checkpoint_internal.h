// Checkpoints inside the engine: the two phases of a load (read and check,
// then apply) for bindings that restore their own optimizer state between
// them, opaque bytes for those bindings, a crash hook for tests, and finding
// the live model that owns a tensor.
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

#include "roundpipe/checkpoint.h"
#include "roundpipe/timer.h"

namespace roundpipe {
namespace detail {

// Records a model so that model_holding() can find it (weakly held).
void note_live_model(const std::shared_ptr<RoundPipe::Impl>& model);
// The live model one of whose parameters or buffers is `tensor` (the same
// tensor object), or null.
std::shared_ptr<RoundPipe::Impl> model_holding(const at::Tensor& tensor);

// Called by the checkpoint writer at each point it passes: "write" after each
// chunk (bytes: written so far), "fsync" before flushing the file, "rename"
// before renaming it over the target, "renamed" after; tests make the
// process die there. Process-wide; null (default) for none.
using CheckpointCrashHook = std::function<void(const char* point, uint64_t bytes)>;
void set_checkpoint_crash_hook(CheckpointCrashHook hook);

// Waits for the model's queued work, its optimizer steps included, without
// publishing the newest step into its parameters (what a save sees).
void quiesce_for_checkpoint(RoundPipe::Impl& model);

// save_checkpoint, plus `extra` bytes stored as they are (may be null).
void save_checkpoint_with(const std::string& path, RoundPipe::Impl& model, const CheckpointState& state,
                          const std::string* extra);

// A checkpoint read from its file and checked against a model, not applied.
struct PendingCheckpoint {
  std::string path;
  std::shared_ptr<RoundPipe::Impl> model;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (model tensor, saved value), all checked
  std::vector<at::Tensor> accum, master_grad, optim_grad;  // [HostParam id] pending gradients or undefined
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
PendingCheckpoint read_checkpoint(const std::string& path, const std::shared_ptr<RoundPipe::Impl>& model);

}  // namespace detail
}  // namespace roundpipe
