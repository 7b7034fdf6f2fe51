// Checkpoints of the whole training state, resumable to a bitwise-identical
// trajectory (docs/guide.md, "6a. Checkpoints"), also on a different number of devices:
//
//   roundpipe::CheckpointState state;
//   state.optimizer = &opt;
//   state.step = step;
//   state.extra_state = batcher.position().to_state();   // roundpipe/token_data.h
//   roundpipe::save_checkpoint("run/ckpt.pt", model, state);
//   ...
//   roundpipe::load_checkpoint("run/ckpt.pt", model, state);   // a fresh model and optimizer
//   batcher.seek(DataPosition::from_state(state.extra_state));
//   for (int64_t s = state.step + 1; ...)                     // same losses as without the break
//
// What a checkpoint holds: the model's master parameters and buffers; the
// optimizer copies, separately (with the one-step delay, or another
// optim_dtype, they differ from the masters); gradients not yet handed to an
// optimizer (the fp32 accumulators, the masters' .grad after synchronize, the
// optimizer copies' .grad); the engine's counters (the seed and call counter
// that key the random streams, the step counter of the sync warm-up, whether
// the masters are one step behind); the ModelTimer state; and what the
// CheckpointState names. Not saved: automatic plans (they follow from the
// timer and the device count; use a fixed ModelExecutePlan for a bitwise
// resume on another device count), the model's options (overlap_iterations,
// sync_warmup_steps: given again when the model is built).
// GradScaler: its state_dict() (torch's keys) is saved. That is its whole
// state with update(is_async=false); with asynchronous updates a growth or
// backoff still pending at the save takes effect one update later after a
// resume than without the break (the parameters' trajectory is bitwise only
// while no such change is pending, e.g. scale changes only on sync updates).
//
// Saving does not change the trajectory: it waits for the step in flight but
// does not publish its result into the masters (the next calls must still see
// θ_{k-1}); both generations are saved and loading restores both.
//
// The file is a libtorch archive (zip; torch::serialize). Saving streams the
// tensors to a temporary file in the same directory, flushes it to disk,
// renames it over `path` and flushes the directory: a crash at any point
// leaves either the previous file or the new one at `path` (a crashed save
// may leave a "<path>.tmp.<pid>.<n>" file behind).
//
// Data parallelism (distributed.h): the state is the same on every process,
// so only rank 0 writes (other ranks return once their checks passed); call
// save_checkpoint on every rank or on rank 0 only, after step() (gradients
// not yet combined are refused). Every process loads the same file (e.g. on a
// shared filesystem); a checkpoint resumes on any number of processes.
//
// Thread-safe as the model's calls (model.h): a save or load is one call of
// the model; from inside the model's step_fn, loss_fn or layers it is an
// error (save after step() returns instead).
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <string>

#include <roundpipe/grad_scaler.h>
#include <roundpipe/model.h>

namespace roundpipe {

// What travels besides the model.
struct CheckpointState {
  // Its state (torch::optim archive: save()/load()) is saved when set, and
  // loaded when set. It must be built over the model's optim_parameters().
  torch::optim::Optimizer* optimizer = nullptr;
  // Its state_dict() is saved when set, and loaded (load_state_dict) when set.
  GradScaler* scaler = nullptr;
  // The user's training-step counter.
  int64_t step = 0;
  // Integers by name that the training program needs to resume where it
  // stopped, e.g. where its data stream stands (DataPosition::to_state in
  // roundpipe/token_data.h). Stored as given; a load replaces it.
  std::map<std::string, int64_t> extra_state;
  // Free-form, e.g. the training program's configuration; stored as given.
  std::string metadata_json = "{}";
};

// Writes the whole training state of `model` to `path` (one file), atomically
// (see the top of this file). Waits for the queued optimizer work first; an
// error of an asynchronous step_fn is rethrown here (nothing is written).
// Throws c10::Error naming the file and the system error when it cannot be
// written (a full disk, a missing directory); the temporary file is then
// removed, the previous file at `path` is unchanged and the model trains on.
// A `path` that is a symbolic link is written through (the file it points to
// is replaced). A save interrupted through an InterruptScope (Python's
// Ctrl-C) rethrows the interrupt and leaves no file.
void save_checkpoint(const std::string& path, RoundPipe& model, const CheckpointState& state);

// Restores a checkpoint into `model`, which must have the same architecture
// (the same parameter and buffer names, shapes and dtypes, the same
// optim_dtype); its device count may differ. The model takes the saved seed
// of its random streams. Fills state.step, extra_state and metadata_json;
// loads the optimizer's and the scaler's state when those are set (the
// optimizer must be built over this model's optim_parameters(), in the same
// order and groups as the saved one). Waits for queued work first.
// c10::ValueError naming the file and the problem for a missing, truncated or
// corrupt file, another architecture (missing, unexpected, mis-shaped
// tensors), or an optimizer/scaler requested that the file does not hold.
// A failed load leaves the model, optimizer, scaler and `state` unchanged.
// Load only files you trust, as with torch.load: the hash catches damage, but
// a file crafted with a matching hash reaches libtorch's archive reader,
// which does not withstand arbitrary bytes (it can crash).
void load_checkpoint(const std::string& path, RoundPipe& model, CheckpointState& state);

}  // namespace roundpipe
