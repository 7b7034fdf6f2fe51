// B10: resident host bytes per parameter of the whole training state of a
// ~220M-parameter Llama-shaped decoder after three full steps on CPU devices,
// for the default configuration (bf16 model, fp32 optimizer copies, AdamW
// with fp32 states) and the compact one (bf16 model and copies, AdamW with
// blockwise 8-bit states). Each configuration runs in a process of its own
// (this program re-executed with --config), measured from /proc/self/status:
//   after: VmRSS after the steps and synchronize(), minus VmRSS before the
//          model was built;
//   peak:  VmHWM (reset just before the model was built) minus the same.
// Whatever the process holds counts: model, copies, states, gradients,
// engine buffers, the CPU devices' memory and the allocator's free lists.
#include <roundpipe/models.h>
#include <roundpipe/optim/adam.h>
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "bench_common.h"

using namespace roundpipe;

namespace {

// A field of /proc/self/status, in bytes.
int64_t status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

// Resets VmHWM to the current VmRSS (Linux >= 4.0).
void reset_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

DecoderConfig config_220m() {
  DecoderConfig c = tiny_llama_config();
  c.vocab_size = 32000;
  c.hidden_size = 1024;
  c.intermediate_size = 2816;
  c.num_hidden_layers = 12;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 16;
  c.head_dim = 0;
  c.tie_word_embeddings = false;
  return c;
}

int run_config(bool compact) {
  constexpr int64_t kBatch = 2, kSeq = 64, kSteps = 3;
  get_num_devices();  // the pool and its threads, before measuring
  {
    torch::nn::Sequential tiny(torch::nn::Linear(2, 2));  // the engine's one-time set-up
    RoundPipe warm_up(tiny);
  }
  const int64_t before = status_bytes("VmRSS");
  reset_peak();
  int64_t params = 0, after = 0;
  {
    // Built in bf16 directly, as a user loads a bf16 checkpoint.
    torch::manual_seed(0);
    const caffe2::TypeMeta default_dtype = c10::get_default_dtype();
    c10::set_default_dtype(caffe2::TypeMeta::Make<c10::BFloat16>());
    torch::nn::Sequential net = make_decoder(config_220m());
    c10::set_default_dtype(default_dtype);
    for (const auto& p : net->parameters()) params += p.numel();
    RoundPipeOptions options;
    options.set_optim_dtype(compact ? at::kBFloat16 : at::kFloat);
    RoundPipe model(net, options);
    optim::AdamW opt(model.optim_parameters(),
                     optim::AdamWOptions(1e-4).state_dtype(compact ? optim::StateDtype::kBlockwise8
                                                                   : optim::StateDtype::kFloat32));
    torch::manual_seed(1);
    const LossFn loss_fn = preset_loss_fn();
    for (int64_t k = 0; k < kSteps; ++k) {
      const at::Tensor ids = torch::randint(32000, {kBatch, kSeq});
      model.forward_backward({ids}, make_kwargs({{"labels", ids}}), ids, loss_fn, false,
                             RunConfig().num_microbatch(2));
      model.step([&opt] {
        opt.step();
        opt.zero_grad();
      });
    }
    model.synchronize();
    after = status_bytes("VmRSS");
  }
  const int64_t peak = status_bytes("VmHWM");
  std::printf("CONFIG %s params=%lld after=%lld peak=%lld\n", compact ? "compact" : "default",
              static_cast<long long>(params), static_cast<long long>(after - before),
              static_cast<long long>(peak - before));
  return 0;
}

struct Measured {
  long long params = 0, after = 0, peak = 0;
};

Measured measure(const char* self, const char* config) {
  const std::string command = std::string("'") + self + "' --config " + config;
  FILE* pipe = popen(command.c_str(), "r");
  Measured m;
  char line[512];
  bool found = false;
  while (pipe != nullptr && std::fgets(line, sizeof(line), pipe) != nullptr) {
    char name[32];
    if (std::sscanf(line, "CONFIG %31s params=%lld after=%lld peak=%lld", name, &m.params, &m.after,
                    &m.peak) == 4) {
      found = true;
    } else {
      std::fputs(line, stdout);
    }
  }
  const int status = pipe != nullptr ? pclose(pipe) : -1;
  if (!found || status != 0) {
    std::fprintf(stderr, "B10: the %s configuration failed (exit status %d)\n", config, status);
    std::exit(1);
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--config") return run_config(std::string(argv[2]) == "compact");
  std::printf("B10 host bytes per parameter — %s\n", bench::machine_line().c_str());
  char self[4096] = {0};
  if (readlink("/proc/self/exe", self, sizeof(self) - 1) <= 0) return 1;
  const Measured def = measure(self, "default");
  const Measured compact = measure(self, "compact");
  const double n = static_cast<double>(def.params);
  std::printf("%-10s %14s %14s\n", "config", "after B/param", "peak B/param");
  std::printf("%-10s %14.2f %14.2f\n", "default", def.after / n, def.peak / n);
  std::printf("%-10s %14.2f %14.2f\n", "compact", compact.after / n, compact.peak / n);
  std::printf("(%lld parameters; after: resident growth after 3 steps and synchronize; peak: VmHWM growth)\n",
              def.params);
  std::printf(
      "RESULT id=B10 bytes_per_param_default=%.2f bytes_per_param_compact=%.2f "
      "peak_bytes_per_param_default=%.2f peak_bytes_per_param_compact=%.2f params=%lld\n",
      def.after / n, compact.after / n, def.peak / n, compact.peak / n, def.params);
  return 0;
}
