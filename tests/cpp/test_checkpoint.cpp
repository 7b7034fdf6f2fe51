// Checkpoints: resuming reproduces the uninterrupted trajectory bitwise (on
// other device counts, with async steps and dropout); saving does not perturb
// it; a crash or SIGKILL during a save leaves the previous file loadable;
// damaged files and other architectures are clear errors that change nothing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <roundpipe/optim/adam.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "engine/checkpoint_internal.h"
#include "engine/engine_access.h"
#include "engine/model_impl.h"
#include "models.h"
#include "scratch_dir.h"

extern char** environ;

namespace roundpipe {
namespace testing {
namespace {

using ::testing::HasSubstr;

std::string temp_dir() { return scratch_dir("roundpipe_ckpt_"); }

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

std::vector<at::Tensor> clones(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : named) out.push_back(t.detach().clone());
  return out;
}

void expect_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << what << " #" << i;
}

// ---- the trajectory: transformer with dropout, fixed plan, Adam, async steps ----

constexpr int kSteps = 20, kSaveAt = 10;

struct Batches {
  std::vector<at::Tensor> ids, targets;
};

const Batches& batches() {
  static Batches b = [] {
    torch::manual_seed(99);
    Batches out;
    for (int i = 0; i < kSteps; ++i) {
      out.ids.push_back(torch::randint(kVocab, {8, kSeq}));
      out.targets.push_back(torch::randint(kVocab, {8, kSeq}));
    }
    return out;
  }();
  return b;
}

struct Trainer {
  torch::nn::Sequential net;
  RoundPipe model;
  optim::Adam opt;
  RunConfig cfg = RunConfig().num_microbatch(4).execute_plan(
      ModelExecutePlan{{{0, 1}, {1, 3}}, {{3, 6}, {2, 3}, {1, 2}, {0, 1}}});

  // `init` seeds the initial weights and the model's random streams; a
  // resumed trainer gets other ones, which the checkpoint must override.
  // With `scaled`, losses go through a GradScaler whose scale grows every
  // third step.
  std::unique_ptr<GradScaler> scaler;

  Trainer(int64_t devices, uint64_t init, bool scaled = false)
      : net((torch::manual_seed(init), make_transformer(/*dropout=*/0.2))),
        model(net, RoundPipeOptions().set_max_devices(devices).set_seed(1000 + init)),
        opt(model.optim_parameters(), optim::AdamOptions(1e-2)) {
    if (scaled) scaler = std::make_unique<GradScaler>(GradScalerOptions().set_init_scale(256).set_growth_interval(3));
  }

  // Step k (1-based): forward_backward on batch k-1, then an async step.
  at::Tensor forward_backward(int k) {
    LossFn loss_fn = [this](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
      at::Tensor loss = lm_loss(out.toTensor(), y.toTensor());
      return scaler ? scaler->scale(loss) : loss;
    };
    const Batches& b = batches();
    return model.forward_backward({b.ids[k - 1]}, make_kwargs(), b.targets[k - 1], loss_fn, false, cfg).toTensor();
  }
  void step(bool is_async) {
    model.step(
        [this] {
          if (scaler) {
            scaler->step(opt);
          } else {
            opt.step();
          }
          opt.zero_grad();
        },
        is_async);
    if (scaler) scaler->update(c10::nullopt, is_async);
  }

  CheckpointState state(int64_t step) {
    CheckpointState s;
    s.optimizer = &opt;
    s.scaler = scaler.get();
    s.step = step;
    s.extra_state = DataPosition{7, 1, step * 8}.to_state();
    s.extra_state["run.attempt"] = 3;
    s.metadata_json = "{\"run\": \"test\"}";
    return s;
  }
};

struct Trajectory {
  std::vector<at::Tensor> losses;     // [step - 1]
  std::vector<at::Tensor> masters;    // after synchronize at the end
  std::vector<at::Tensor> copies;     // optimizer copies at the end
};

enum class SavePoint { kNone, kAfterStep, kBeforeStep };

// Steps first..kSteps; saves at kSaveAt (after its step, or between its
// forward_backward and its step).
void run_steps(Trainer& t, int first, Trajectory& out, SavePoint save, const std::string& path, bool is_async) {
  for (int k = first; k <= kSteps; ++k) {
    out.losses.push_back(t.forward_backward(k));
    if (k == kSaveAt && save == SavePoint::kBeforeStep) save_checkpoint(path, t.model, t.state(k - 1));
    t.step(is_async);
    if (k == kSaveAt && save == SavePoint::kAfterStep) save_checkpoint(path, t.model, t.state(k));
  }
  t.model.synchronize();
  out.masters = clones(t.model.state_dict());
  out.copies = clones(t.model.optim_named_parameters());
}

Trajectory uninterrupted(int64_t devices, SavePoint save, const std::string& path, bool is_async = true,
                         bool scaled = false) {
  Trainer t(devices, /*init=*/7, scaled);
  Trajectory out;
  run_steps(t, 1, out, save, path, is_async);
  return out;
}

Trajectory resumed(int64_t devices, SavePoint save, const std::string& path, bool is_async = true,
                   bool scaled = false) {
  Trainer t(devices, /*init=*/8, scaled);
  CheckpointState state;
  state.optimizer = &t.opt;
  state.scaler = t.scaler.get();
  load_checkpoint(path, t.model, state);
  const int64_t saved_step = save == SavePoint::kAfterStep ? kSaveAt : kSaveAt - 1;
  EXPECT_EQ(state.step, saved_step);
  EXPECT_EQ(DataPosition::from_state(state.extra_state), (DataPosition{7, 1, saved_step * 8}));
  EXPECT_EQ(state.extra_state.at("run.attempt"), 3);
  EXPECT_EQ(state.extra_state.size(), 4u);
  EXPECT_EQ(state.metadata_json, "{\"run\": \"test\"}");
  Trajectory out;
  if (save == SavePoint::kBeforeStep) {
    // The checkpoint holds step kSaveAt's gradients, not yet stepped.
    out.losses.push_back(at::Tensor());
    t.step(is_async);
    run_steps(t, kSaveAt + 1, out, SavePoint::kNone, path, is_async);
  } else {
    run_steps(t, kSaveAt + 1, out, SavePoint::kNone, path, is_async);
  }
  return out;
}

void expect_resumed_equal(const Trajectory& full, const Trajectory& part, const std::string& what) {
  ASSERT_GE(full.losses.size(), static_cast<size_t>(kSteps));
  const size_t skip = full.losses.size() - part.losses.size();
  for (size_t i = 0; i < part.losses.size(); ++i) {
    if (!part.losses[i].defined()) continue;
    EXPECT_TRUE(at::equal(full.losses[skip + i], part.losses[i])) << what << " loss of step " << skip + i + 1;
  }
  expect_equal(full.masters, part.masters, what + ": parameters and buffers");
  expect_equal(full.copies, part.copies, what + ": optimizer copies");
}

TEST(Checkpoint, SavingDoesNotPerturbTheTrajectory) {
  const Trajectory plain = uninterrupted(2, SavePoint::kNone, "");
  const Trajectory saving = uninterrupted(2, SavePoint::kAfterStep, temp_dir() + "/perturb.ckpt");
  expect_resumed_equal(plain, saving, "with a save at step 10");
  for (size_t i = 0; i < plain.losses.size(); ++i) EXPECT_TRUE(at::equal(plain.losses[i], saving.losses[i])) << i;
}

TEST(Checkpoint, ResumeIsBitwiseIdenticalOnOtherDeviceCountsWithDropoutAndAsyncSteps) {
  const std::string path = temp_dir() + "/resume.ckpt";
  const Trajectory full = uninterrupted(2, SavePoint::kAfterStep, path);
  // Dropout is active: another seed of the random streams changes the losses.
  for (int64_t devices : {1, 2, 3}) {
    expect_resumed_equal(full, resumed(devices, SavePoint::kAfterStep, path), "resumed on " + std::to_string(devices) + " devices");
  }
}

TEST(Checkpoint, ResumeBetweenForwardBackwardAndStepKeepsThePendingGradients) {
  const std::string path = temp_dir() + "/pending.ckpt";
  const Trajectory full = uninterrupted(2, SavePoint::kBeforeStep, path);
  expect_resumed_equal(full, resumed(3, SavePoint::kBeforeStep, path), "resumed with pending gradients");
}

TEST(Checkpoint, ResumeWithSynchronousSteps) {
  const std::string path = temp_dir() + "/sync.ckpt";
  const Trajectory full = uninterrupted(2, SavePoint::kAfterStep, path, /*is_async=*/false);
  expect_resumed_equal(full, resumed(1, SavePoint::kAfterStep, path, /*is_async=*/false), "synchronous");
}

// With synchronous steps and updates the scaler's state_dict is its whole
// state. (With asynchronous updates a growth or backoff still pending at the
// save takes effect one update later after a resume: checkpoint.h.)
TEST(Checkpoint, ResumeWithAGradScalerAndSynchronousUpdates) {
  const std::string path = temp_dir() + "/scaled.ckpt";
  const Trajectory full = uninterrupted(2, SavePoint::kAfterStep, path, /*is_async=*/false, /*scaled=*/true);
  expect_resumed_equal(full, resumed(3, SavePoint::kAfterStep, path, /*is_async=*/false, /*scaled=*/true),
                       "scaled, synchronous");
}

TEST(Checkpoint, RestoresTimerSeedAndScaler) {
  const std::string path = temp_dir() + "/timer.ckpt";
  torch::manual_seed(3);
  RoundPipe a(make_mlp(), RoundPipeOptions().set_max_devices(2).set_seed(77));
  a.forward_backward({torch::randn({6, 16})}, make_kwargs(), torch::randn({6, 4}), mse_loss_fn());
  a.forward_backward({torch::randn({6, 16})}, make_kwargs(), torch::randn({6, 4}), mse_loss_fn());
  GradScaler scaler(GradScalerOptions().set_init_scale(512).set_growth_interval(3));
  scaler.update(1024.0);
  CheckpointState saved;
  saved.scaler = &scaler;
  save_checkpoint(path, a, saved);

  RoundPipe b(make_mlp(), RoundPipeOptions().set_max_devices(1).set_seed(5));
  GradScaler other;
  CheckpointState state;
  state.scaler = &other;
  load_checkpoint(path, b, state);
  EXPECT_EQ(other.get_scale(), 1024.0);
  EXPECT_EQ(other.get_growth_interval(), 3);
  const auto ta = a.timer().state(), tb = b.timer().state();
  ASSERT_EQ(ta.size(), tb.size());
  for (size_t i = 0; i < ta.size(); ++i) {
    EXPECT_EQ(ta[i].warmed_up, tb[i].warmed_up) << i;
    EXPECT_EQ(ta[i].count, tb[i].count) << i;
    EXPECT_EQ(ta[i].biased_mean, tb[i].biased_mean) << i;
  }
  const auto engine = detail::EngineAccess::impl(b)->export_state();
  EXPECT_EQ(engine.pipeline.seed, 77u);
  EXPECT_EQ(engine.pipeline.next_call_id, 2);
}

// ---- errors: nothing changes ----

struct Snapshot {
  std::vector<at::Tensor> state, copies;
  explicit Snapshot(RoundPipe& m) : state(clones(m.state_dict())), copies(clones(m.optim_named_parameters())) {}
  void expect_same(RoundPipe& m) const {
    expect_equal(state, clones(m.state_dict()), "parameters and buffers after a failed load");
    expect_equal(copies, clones(m.optim_named_parameters()), "optimizer copies after a failed load");
  }
};

std::string save_mlp(const std::string& name, int64_t width, int64_t depth, bool with_optimizer) {
  const std::string path = temp_dir() + "/" + name;
  torch::manual_seed(11);
  RoundPipe model(make_mlp(width, depth), RoundPipeOptions().set_max_devices(2));
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  model.forward_backward({torch::randn({6, width})}, make_kwargs(), torch::randn({6, 4}), mse_loss_fn());
  model.step([&] { opt.step(); });
  CheckpointState state;
  if (with_optimizer) state.optimizer = &opt;
  save_checkpoint(path, model, state);
  return path;
}

TEST(Checkpoint, MissingTruncatedAndCorruptFilesAreValueErrors) {
  const std::string good = save_mlp("good.ckpt", 16, 4, true);
  const std::string bytes = read_bytes(good);
  ASSERT_GT(bytes.size(), 1000u);
  torch::manual_seed(12);
  RoundPipe model(make_mlp(), RoundPipeOptions().set_max_devices(1));
  const Snapshot before(model);
  CheckpointState state;
  state.step = 42;

  EXPECT_THAT(value_error_of([&] { load_checkpoint(temp_dir() + "/absent.ckpt", model, state); }),
              HasSubstr("cannot open"));
  const std::string bad = temp_dir() + "/bad.ckpt";
  std::vector<std::pair<std::string, std::string>> cases = {
      {"empty", ""},
      {"garbage", std::string(5000, 'x')},
      {"first 100 bytes", bytes.substr(0, 100)},
      {"half", bytes.substr(0, bytes.size() / 2)},
      {"all but one byte", bytes.substr(0, bytes.size() - 1)},
  };
  for (size_t at : {bytes.size() / 3, bytes.size() / 2, bytes.size() - 30}) {
    std::string flipped = bytes;
    flipped[at] = static_cast<char>(flipped[at] ^ 0x5a);
    cases.emplace_back("a flipped byte at " + std::to_string(at), flipped);
  }
  for (const auto& [what, content] : cases) {
    write_bytes(bad, content);
    EXPECT_THAT(value_error_of([&] { load_checkpoint(bad, model, state); }), HasSubstr(bad)) << what;
    before.expect_same(model);
    EXPECT_EQ(state.step, 42) << what;
  }
  load_checkpoint(good, model, state);  // still usable after the failures
  EXPECT_EQ(state.step, 0);
}

TEST(Checkpoint, AnotherArchitectureIsAValueErrorThatChangesNothing) {
  const std::string path = save_mlp("arch.ckpt", 16, 4, true);
  torch::manual_seed(13);
  RoundPipe fewer_layers(make_mlp(16, 3), RoundPipeOptions().set_max_devices(1));
  CheckpointState state;
  EXPECT_THAT(value_error_of([&] { load_checkpoint(path, fewer_layers, state); }), HasSubstr("layers"));

  RoundPipe narrower(make_mlp(8, 4), RoundPipeOptions().set_max_devices(1));
  torch::optim::SGD opt(narrower.optim_parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const Snapshot before(narrower);
  state.optimizer = &opt;
  EXPECT_THAT(value_error_of([&] { load_checkpoint(path, narrower, state); }), HasSubstr("has shape"));
  before.expect_same(narrower);

  torch::nn::Sequential bf16 = make_mlp();
  bf16->to(at::kBFloat16);
  RoundPipe other_dtype(bf16, RoundPipeOptions().set_max_devices(1));
  EXPECT_THAT(value_error_of([&] { load_checkpoint(path, other_dtype, state); }), HasSubstr("dtype"));
}

TEST(Checkpoint, AnOptimizerTheFileDoesNotHoldIsAValueError) {
  const std::string path = save_mlp("no_opt.ckpt", 16, 4, false);
  torch::manual_seed(14);
  RoundPipe model(make_mlp(), RoundPipeOptions().set_max_devices(1));
  torch::optim::SGD opt(model.optim_parameters(), torch::optim::SGDOptions(0.1));
  const Snapshot before(model);
  CheckpointState state;
  state.optimizer = &opt;
  EXPECT_THAT(value_error_of([&] { load_checkpoint(path, model, state); }), HasSubstr("no optimizer state"));
  before.expect_same(model);
}

TEST(Checkpoint, OptimizerStateRoundTrips) {
  // A model and its SGD with momentum, saved after one step; a fresh pair
  // loads it; one more identical step on both must agree bitwise (the
  // momentum buffers came back).
  const std::string path = temp_dir() + "/opt.ckpt";
  torch::manual_seed(15);
  const at::Tensor x1 = torch::randn({6, 16}), y1 = torch::randn({6, 4});
  const at::Tensor x2 = torch::randn({6, 16}), y2 = torch::randn({6, 4});
  RoundPipe a(make_mlp(), RoundPipeOptions().set_max_devices(2));
  torch::optim::SGD opt_a(a.optim_parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  RoundPipe b(make_mlp(), RoundPipeOptions().set_max_devices(2));  // the same default plan
  torch::optim::SGD opt_b(b.optim_parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  a.forward_backward({x1}, make_kwargs(), y1, mse_loss_fn());
  a.step([&] { opt_a.step(); opt_a.zero_grad(); }, /*is_async=*/false);
  CheckpointState state;
  state.optimizer = &opt_a;
  save_checkpoint(path, a, state);
  state.optimizer = &opt_b;
  load_checkpoint(path, b, state);
  for (auto* m : {&a, &b}) m->forward_backward({x2}, make_kwargs(), y2, mse_loss_fn());
  a.step([&] { opt_a.step(); }, /*is_async=*/false);
  b.step([&] { opt_b.step(); }, /*is_async=*/false);
  expect_equal(clones(a.optim_named_parameters()), clones(b.optim_named_parameters()), "after one more step");
}

// ---- crash safety: a child process overwrites a checkpoint and dies ----

// The child: builds a deterministic MLP trained `steps` steps and saves it
// (with step = steps) to $ROUNDPIPE_CKPT_CHILD; dies (_exit(3)) at
// $ROUNDPIPE_CKPT_CRASH = "<point>:<bytes>" of the writer; with
// $ROUNDPIPE_CKPT_LOOP it saves over and over (after touching "<path>.ready")
// until killed. Skipped unless run by the crash tests.
std::unique_ptr<RoundPipe> child_model(int steps, std::unique_ptr<torch::optim::SGD>& opt) {
  torch::manual_seed(31);
  auto model = std::make_unique<RoundPipe>(make_mlp(256, 4), RoundPipeOptions().set_max_devices(1).set_seed(3));
  opt = std::make_unique<torch::optim::SGD>(model->optim_parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int k = 0; k < steps; ++k) {
    model->forward_backward({torch::randn({6, 256})}, make_kwargs(), torch::randn({6, 4}), mse_loss_fn());
    model->step([&] { opt->step(); });
  }
  return model;
}

TEST(CheckpointCrashChild, Save) {
  const char* path = std::getenv("ROUNDPIPE_CKPT_CHILD");
  if (path == nullptr) GTEST_SKIP() << "run by the CheckpointCrash tests";
  const int steps = std::atoi(std::getenv("ROUNDPIPE_CKPT_STEPS"));
  std::unique_ptr<torch::optim::SGD> opt;
  auto model = child_model(steps, opt);
  CheckpointState state;
  state.optimizer = opt.get();
  state.step = steps;
  if (const char* crash = std::getenv("ROUNDPIPE_CKPT_CRASH")) {
    const std::string spec = crash;
    const std::string point = spec.substr(0, spec.find(':'));
    const uint64_t bytes = std::stoull(spec.substr(spec.find(':') + 1));
    detail::set_checkpoint_crash_hook([point, bytes](const char* at, uint64_t written) {
      if (point == at && written >= bytes) ::_exit(3);
    });
  }
  if (std::getenv("ROUNDPIPE_CKPT_LOOP") != nullptr) {
    save_checkpoint(path, *model, state);
    write_bytes(std::string(path) + ".ready", "");
    for (;;) save_checkpoint(path, *model, state);
  }
  save_checkpoint(path, *model, state);
}

// Runs the child; returns its pid (waits for it unless `background`).
pid_t run_child(const std::string& path, int steps, const std::string& crash, bool loop, int* status) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  env.push_back("ROUNDPIPE_CKPT_CHILD=" + path);
  env.push_back("ROUNDPIPE_CKPT_STEPS=" + std::to_string(steps));
  if (!crash.empty()) env.push_back("ROUNDPIPE_CKPT_CRASH=" + crash);
  if (loop) env.push_back("ROUNDPIPE_CKPT_LOOP=1");
  std::vector<char*> envp;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", filter = "--gtest_filter=CheckpointCrashChild.Save";
  char* argv[] = {exe.data(), filter.data(), nullptr};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);  // quiet child
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  EXPECT_EQ(rc, 0);
  if (status != nullptr) waitpid(pid, status, 0);
  return pid;
}

// Loads `path` into a fresh child model; returns the step and the state.
std::pair<int64_t, std::vector<at::Tensor>> load_child_checkpoint(const std::string& path) {
  std::unique_ptr<torch::optim::SGD> opt;
  auto model = child_model(0, opt);
  CheckpointState state;
  state.optimizer = opt.get();
  load_checkpoint(path, *model, state);
  return {state.step, clones(model->state_dict())};
}

TEST(CheckpointCrash, DyingAtAnyPointOfASaveLeavesAValidCheckpoint) {
  const std::string ref1 = temp_dir() + "/ref1.ckpt", ref2 = temp_dir() + "/ref2.ckpt";
  int status = 0;
  run_child(ref1, 1, "", false, &status);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  run_child(ref2, 2, "", false, &status);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const auto one = load_child_checkpoint(ref1), two = load_child_checkpoint(ref2);
  ASSERT_EQ(one.first, 1);
  ASSERT_EQ(two.first, 2);
  const uint64_t size = read_bytes(ref2).size();

  struct Case {
    std::string crash;
    int64_t expected_step;
  };
  const std::vector<Case> cases = {{"write:1", 1},           {"write:" + std::to_string(size / 2), 1},
                                   {"write:" + std::to_string(size), 1}, {"fsync:0", 1},
                                   {"rename:0", 1},          {"renamed:0", 2}};
  for (const Case& c : cases) {
    const std::string path = temp_dir() + "/crash.ckpt";
    write_bytes(path, read_bytes(ref1));
    run_child(path, 2, c.crash, false, &status);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << c.crash << ": the child did not die there";
    const auto got = load_child_checkpoint(path);
    EXPECT_EQ(got.first, c.expected_step) << c.crash;
    expect_equal(got.second, c.expected_step == 1 ? one.second : two.second, "after a crash at " + c.crash);
  }
}

TEST(CheckpointCrash, SigkillDuringSavesLeavesAValidCheckpoint) {
  const std::string ref1 = temp_dir() + "/kill_ref1.ckpt", ref2 = temp_dir() + "/kill_ref2.ckpt";
  int status = 0;
  run_child(ref1, 1, "", false, &status);
  run_child(ref2, 2, "", false, &status);
  const auto one = load_child_checkpoint(ref1), two = load_child_checkpoint(ref2);
  for (int delay_ms : {0, 3, 11, 29, 57}) {
    const std::string path = temp_dir() + "/kill.ckpt";
    write_bytes(path, read_bytes(ref1));
    ::unlink((path + ".ready").c_str());
    const pid_t pid = run_child(path, 2, "", /*loop=*/true, nullptr);
    // Wait until the child saves in a loop, then kill it at some moment.
    for (int i = 0; i < 3000 && ::access((path + ".ready").c_str(), F_OK) != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the child ended by itself";
    const auto got = load_child_checkpoint(path);
    EXPECT_EQ(got.first, 2) << delay_ms;  // one save completed before "ready"
    expect_equal(got.second, two.second, "after SIGKILL at +" + std::to_string(delay_ms) + " ms");
  }
  (void)one;
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
