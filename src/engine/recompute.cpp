#include <ATen/ATen.h>

#include "engine/recompute_context.h"
#include "util/value_tree.h"
#include "roundpipe/recompute.h"

namespace roundpipe {
namespace {
thread_local LayerRunState* tls_run = nullptr;
}  // namespace

LayerRunScope::LayerRunScope(LayerRunState* state) : previous_(tls_run) { tls_run = state; }
LayerRunScope::~LayerRunScope() { tls_run = previous_; }

void save_for_recompute(std::vector<c10::IValue> data) {
  if (tls_run == nullptr || tls_run->mode != RunMode::kSaving) return;
  TORCH_CHECK(!tls_run->saved, "save_for_recompute() may be called at most once per layer forward");
  for (const auto& value : data) {
    for (const at::Tensor& t : flatten_tensors(value)) {
      TORCH_CHECK_VALUE(!t.requires_grad(), "save_for_recompute(): tensors must not require grad; ",
                        "pass t.detach()");
    }
  }
  tls_run->saved = true;
  tls_run->data = std::move(data);
}

bool doing_recompute() { return tls_run != nullptr && tls_run->mode == RunMode::kRecompute; }

std::vector<c10::IValue> get_recompute_data() {
  TORCH_CHECK(doing_recompute(), "get_recompute_data() called outside recomputation; ",
              "check doing_recompute() first");
  TORCH_CHECK(tls_run->data.has_value(),
              "get_recompute_data(): this layer's forward did not call save_for_recompute()");
  return *tls_run->data;
}

}  // namespace roundpipe
