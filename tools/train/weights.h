// Initial weights for roundpipe-train: a Hugging Face safetensors checkpoint
// loaded into a make_decoder() model by name (hf_parameter_names).
#pragma once

#include <roundpipe/presets.h>

#include <cstdint>
#include <string>

namespace roundpipe {
namespace train {

// Copies every parameter of `net` (built by make_decoder(config), before any
// dtype change) from the checkpoint at `path` (a file, an index or a
// directory; see load_safetensors_checkpoint), converting dtypes. Returns the
// number of tensors loaded. Throws c10::ValueError naming the tensor when one
// is missing or its shape differs; tensors the model does not use (e.g.
// rotary tables) are ignored, and their count is returned in `unused`.
int64_t load_hf_weights(torch::nn::Sequential& net, const DecoderConfig& config,
                        const std::string& path, int64_t* unused);

}  // namespace train
}  // namespace roundpipe
