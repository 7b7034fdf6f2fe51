// Hooks for layers whose recomputation needs data from their first forward.
// Call them from inside a layer's forward.
//
// Thread-safety: they act on the calling thread's current layer run.
#pragma once

#include <ATen/core/ivalue.h>

#include <vector>

namespace roundpipe {

// Keeps `data` for this layer's recomputation (tensors must not require grad).
// At most once per layer forward. A no-op when no backward follows (grad off)
// or in the fused stage, which is never recomputed.
void save_for_recompute(std::vector<c10::IValue> data);

// True while the calling layer is being recomputed.
bool doing_recompute();

// The data saved by save_for_recompute in the forward being recomputed.
// Throws (TORCH_CHECK) outside recomputation or when nothing was saved.
std::vector<c10::IValue> get_recompute_data();

}  // namespace roundpipe
