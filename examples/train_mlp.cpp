// Trains a small MLP with RoundPipe on the device pool and reports loss,
// throughput and per-device peak memory.
//
//   ROUNDPIPE_DEVICES=cpu:2 ./roundpipe-example [steps]
#include <roundpipe/roundpipe.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::stoi(argv[1]) : 300;
  torch::manual_seed(0);
  const int64_t in = 32, hidden = 128, classes = 8, batch = 64;

  // A fixed random "teacher" labels the data, so there is something to learn.
  auto teacher = torch::randn({in, classes});
  torch::nn::Sequential net(torch::nn::Linear(in, hidden), torch::nn::ReLU(),
                            torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                            torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                            torch::nn::Linear(hidden, classes));
  roundpipe::RoundPipe model(net, roundpipe::RoundPipeOptions().set_name("mlp"));
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(3e-3));
  const int64_t microbatches = model.num_devices() + 1;
  roundpipe::LossFn loss_fn = [&](const c10::IValue& out, const c10::IValue& label) -> c10::IValue {
    return torch::nn::functional::cross_entropy(out.toTensor(), label.toTensor()) / microbatches;
  };

  std::printf("roundpipe example: %d steps, MLP %lld-%lld-%lld, batch %lld, %lld device(s)\n", steps,
              (long long)in, (long long)hidden, (long long)classes, (long long)batch,
              (long long)model.num_devices());
  const auto start = std::chrono::steady_clock::now();
  double first_loss = 0, last_loss = 0;
  for (int step = 1; step <= steps; ++step) {
    auto x = torch::randn({batch, in});
    auto y = x.matmul(teacher).argmax(1);
    double loss = model.forward_backward({x}, roundpipe::make_kwargs(), y, loss_fn).toTensor().item<double>();
    model.synchronize();  // hands the accumulated gradients to .grad
    optimizer.step();
    optimizer.zero_grad();
    if (step == 1) first_loss = loss;
    last_loss = loss;
    if (step == 1 || step % 50 == 0 || step == steps) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("step %4d  loss %.4f  %.0f samples/s\n", step, loss, step * batch / secs);
    }
  }
  for (const auto& d : roundpipe::device_memory_stats()) {
    std::printf("%s peak memory %.2f MiB\n", d.device.c_str(), d.max_allocated_bytes / 1048576.0);
  }
  std::printf("loss %.4f -> %.4f\n", first_loss, last_loss);
  return last_loss < first_loss ? 0 : 1;
}
