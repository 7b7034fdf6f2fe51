// Trains the tiny Llama preset for a few steps through the installed
// package; prints the first and last loss. Exits non-zero unless the loss
// falls.
#include <roundpipe/models.h>
#include <roundpipe/optim/adam.h>
#include <roundpipe/roundpipe.h>

#include <cstdio>

int main() {
  torch::manual_seed(0);
  roundpipe::DecoderConfig config = roundpipe::tiny_llama_config();
  roundpipe::RoundPipe model(roundpipe::make_decoder(config));
  roundpipe::optim::AdamW opt(model.optim_parameters(), roundpipe::optim::AdamWOptions(1e-2));
  const at::Tensor tokens = roundpipe::default_token_data().slice(0, 0, 4 * 33).view({4, 33});
  const at::Tensor inputs = tokens.slice(1, 0, 32), labels = tokens.slice(1, 1, 33);
  double first = 0, last = 0;
  for (int step = 0; step < 8; ++step) {
    const at::Tensor loss =
        model
            .forward_backward({inputs}, roundpipe::make_kwargs({{"labels", labels}}), c10::IValue(),
                              roundpipe::preset_loss_fn())
            .toTensor();
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
    (step == 0 ? first : last) = loss.item<double>();
  }
  model.synchronize();
  std::printf("consumer: loss %.4f -> %.4f\n", first, last);
  return last < first ? 0 : 1;
}
