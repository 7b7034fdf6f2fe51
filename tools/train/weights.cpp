#include "weights.h"

#include <roundpipe/safetensors.h>

#include <torch/torch.h>

#include <map>
#include <set>

namespace roundpipe {
namespace train {

int64_t load_hf_weights(torch::nn::Sequential& net, const DecoderConfig& config,
                        const std::string& path, int64_t* unused) {
  NamedTensors file = load_safetensors_checkpoint(path);
  std::map<std::string, at::Tensor> by_name(file.begin(), file.end());
  auto params = net->named_parameters();
  std::set<std::string> used;
  torch::NoGradGuard no_grad;
  int64_t loaded = 0;
  for (const auto& [ours, hf] : hf_parameter_names(config)) {
    auto it = by_name.find(hf);
    TORCH_CHECK_VALUE(it != by_name.end(), "--weights '", path, "' has no tensor '", hf,
                      "' (the model's ", ours, "); is it a checkpoint of this config?");
    at::Tensor& dst = params[ours];
    TORCH_CHECK_VALUE(it->second.sizes() == dst.sizes(), "--weights '", path, "': tensor '", hf,
                      "' has shape ", it->second.sizes(), " but the model's ", ours, " has ",
                      dst.sizes());
    dst.copy_(it->second);
    used.insert(hf);
    ++loaded;
  }
  if (unused != nullptr) *unused = static_cast<int64_t>(by_name.size() - used.size());
  return loaded;
}

}  // namespace train
}  // namespace roundpipe
