// Data parallelism (distributed.h): W processes x cpu:1, each on its share of
// the batch, against one process training on the concatenated batch with the
// same microbatches; a peer killed mid-run; resume of a W-process checkpoint
// in one process. The processes are this test binary run again
// (DataParallelChild.Train), meeting through a file store.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <thread>

#include "models.h"
#include "roundpipe/optim/adam.h"
#include "scratch_dir.h"

extern char** environ;

namespace roundpipe {
namespace testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kRowsPerRank = 4, kMicrobatchesPerRank = 2;

std::string temp_dir() { return scratch_dir("roundpipe_dp_"); }

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The global batch of step k (1-based) for `world` processes: process r
// trains on rows [r * kRowsPerRank, (r + 1) * kRowsPerRank).
std::pair<at::Tensor, at::Tensor> global_batch(int64_t k, int64_t world) {
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(500 + k));
  at::Tensor ids = at::randint(kVocab, {world * kRowsPerRank, kSeq}, gen, at::kLong);
  at::Tensor targets = at::randint(kVocab, {world * kRowsPerRank, kSeq}, gen, at::kLong);
  return {ids, targets};
}

LossFn lm_loss_fn() {
  return [](const c10::IValue& out, const c10::IValue& y) -> c10::IValue {
    return lm_loss(out.toTensor(), y.toTensor());
  };
}

// One trainer: a dropout transformer with Adam. `rank` >= 0 joins `group`;
// ranks start from other weights and seeds than rank 0 (the group must copy
// rank 0's). `compact`: bf16 optimizer copies (so bf16 gradient sums, which
// the reduction widens to fp32 and the hand-off rounds back) and Adam's
// compact states.
struct Trainer {
  torch::nn::Sequential net;
  RoundPipe model;
  optim::Adam opt;
  RunConfig cfg;

  Trainer(int64_t rank, std::shared_ptr<ProcessGroup> group, int64_t microbatches,
          bool compact = false)
      : net((torch::manual_seed(100 + std::max<int64_t>(rank, 0)),
             make_transformer(/*dropout=*/0.2))),
        model(net, RoundPipeOptions()
                       .set_seed(1000 + std::max<int64_t>(rank, 0))
                       .set_process_group(group)
                       .set_optim_dtype(compact ? at::kBFloat16 : at::kFloat)),
        opt(model.optim_parameters(),
            optim::AdamOptions(1e-2).state_dtype(compact ? optim::StateDtype::kBlockwise8
                                                         : optim::StateDtype::kFloat32)),
        cfg(RunConfig().num_microbatch(microbatches)) {}

  at::Tensor train_step(const at::Tensor& ids, const at::Tensor& targets, bool is_async) {
    at::Tensor loss =
        model.forward_backward({ids}, make_kwargs(), targets, lm_loss_fn(), false, cfg).toTensor();
    model.step(
        [this] {
          opt.step();
          opt.zero_grad();
        },
        is_async);
    return loss;
  }

  // The parameters after synchronize. (Buffers stay per process: each
  // follows its own microbatches.)
  std::vector<at::Tensor> parameters() {
    model.synchronize();
    return values_of(model.parameters());
  }
};

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v == nullptr ? fallback : std::stoll(v);
}

// A process of a data-parallel run (spawned by the tests below). Writes its
// losses and final parameters to <dir>/rank<r>.pt, or its error to <dir>/rank<r>.err.
// ROUNDPIPE_DP_DIE_AT=k: the last rank kills itself before step k;
// ROUNDPIPE_DP_HANG_AT=k: it sleeps three timeouts there instead;
// ROUNDPIPE_DP_COMPACT=1: the compact optimizer state (Trainer).
TEST(DataParallelChild, Train) {
  const char* dir_env = std::getenv("ROUNDPIPE_DP_DIR");
  if (dir_env == nullptr) GTEST_SKIP() << "run by the DataParallel tests";
  const std::string dir = dir_env;
  const int64_t rank = env_int("RANK", 0), world = env_int("WORLD_SIZE", 1);
  const int64_t steps = env_int("ROUNDPIPE_DP_STEPS", 5),
                die_at = env_int("ROUNDPIPE_DP_DIE_AT", -1);
  const int64_t hang_at = env_int("ROUNDPIPE_DP_HANG_AT", -1),
                timeout_ms = env_int("ROUNDPIPE_DP_TIMEOUT_MS", 60000);
  const bool is_async = env_int("ROUNDPIPE_DP_ASYNC", 1) != 0;
  const bool compact = env_int("ROUNDPIPE_DP_COMPACT", 0) != 0;
  try {
    auto group = ProcessGroup::create(ProcessGroupOptions()
                                          .set_init_method(std::getenv("ROUNDPIPE_DP_INIT"))
                                          .set_timeout(std::chrono::milliseconds(timeout_ms)));
    Trainer t(rank, group, kMicrobatchesPerRank, compact);
    std::vector<at::Tensor> losses;
    for (int64_t k = 1; k <= steps; ++k) {
      if (k == die_at && rank == world - 1)
        ::kill(::getpid(), SIGKILL);  // a peer that dies mid-run
      if (k == hang_at &&
          rank == world - 1) {  // a peer that stops answering (its connections stay open)
        std::this_thread::sleep_for(std::chrono::milliseconds(3 * timeout_ms));
      }
      auto [ids, targets] = global_batch(k, world);
      losses.push_back(t.train_step(ids.narrow(0, rank * kRowsPerRank, kRowsPerRank),
                                    targets.narrow(0, rank * kRowsPerRank, kRowsPerRank),
                                    is_async));
    }
    if (const char* ckpt = std::getenv("ROUNDPIPE_DP_SAVE")) {
      CheckpointState state;
      state.optimizer = &t.opt;
      state.step = steps;
      save_checkpoint(ckpt, t.model, state);  // before synchronize, which would publish θ_k early
    }
    std::vector<at::Tensor> out = t.parameters();
    out.push_back(at::stack(losses));
    torch::save(out, dir + "/rank" + std::to_string(rank) + ".pt");
  } catch (const std::exception& e) {
    std::ofstream(dir + "/rank" + std::to_string(rank) + ".err") << e.what();
    FAIL() << e.what();
  }
}

struct Child {
  pid_t pid = 0;
  int status = 0;
  bool done = false;
  double seconds = 0;  // from the start of the group to its exit
};

// Runs `world` processes of DataParallelChild.Train with `env` added; waits
// for all of them, killing them after `deadline` (a hang is a failure).
std::vector<Child> run_group(int64_t world, const std::string& dir,
                             const std::vector<std::string>& env_extra,
                             std::chrono::seconds deadline = std::chrono::seconds(240)) {
  ::mkdir(dir.c_str(), 0755);
  static int groups = 0;
  const std::string store = dir + "/store" + std::to_string(groups++);
  std::vector<Child> children(static_cast<size_t>(world));
  for (int64_t r = 0; r < world; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      if (entry.rfind("ROUNDPIPE_DEVICES=", 0) != 0) env.push_back(entry);
    }
    env.push_back("ROUNDPIPE_DEVICES=cpu:1");
    env.push_back("ROUNDPIPE_DP_DIR=" + dir);
    env.push_back("ROUNDPIPE_DP_INIT=file://" + store);
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(world));
    for (const auto& e : env_extra) env.push_back(e);
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe", filter = "--gtest_filter=DataParallelChild.Train";
    char* argv[] = {exe.data(), filter.data(), nullptr};
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);  // quiet children
    EXPECT_EQ(posix_spawn(&children[r].pid, exe.c_str(), &actions, nullptr, argv, envp.data()), 0);
    posix_spawn_file_actions_destroy(&actions);
  }
  const auto start = std::chrono::steady_clock::now(), end = start + deadline;
  for (size_t left = children.size(); left > 0;) {
    for (Child& c : children) {
      if (!c.done && ::waitpid(c.pid, &c.status, WNOHANG) == c.pid) {
        c.done = true;
        c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        --left;
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > end) {
      for (Child& c : children) {
        if (!c.done) ::kill(c.pid, SIGKILL);
      }
      ADD_FAILURE() << "a data-parallel process did not end within " << deadline.count() << " s";
      for (Child& c : children) {
        if (!c.done) ::waitpid(c.pid, &c.status, 0);
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return children;
}

bool exited_ok(const Child& c) {
  return c.done && WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
}

std::vector<at::Tensor> load_result(const std::string& dir, int64_t rank) {
  std::vector<at::Tensor> out;
  torch::load(out, dir + "/rank" + std::to_string(rank) + ".pt");
  return out;
}

// One process on the concatenated batches, W * M microbatches.
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> reference(int64_t world, int64_t steps,
                                                                      bool is_async,
                                                                      bool compact = false) {
  Trainer t(-1, nullptr, world * kMicrobatchesPerRank, compact);
  std::vector<at::Tensor> losses;
  for (int64_t k = 1; k <= steps; ++k) {
    auto [ids, targets] = global_batch(k, world);
    losses.push_back(t.train_step(ids, targets, is_async));
  }
  return {t.parameters(), losses};
}

void expect_matches_one_process(int64_t world, bool is_async) {
  const std::string dir = temp_dir() + "/w" + std::to_string(world) + (is_async ? "async" : "sync");
  const std::vector<Child> children =
      run_group(world, dir, {"ROUNDPIPE_DP_ASYNC=" + std::string(is_async ? "1" : "0")});
  for (int64_t r = 0; r < world; ++r) {
    ASSERT_TRUE(exited_ok(children[r]))
        << "rank " << r << ": " << read_text(dir + "/rank" + std::to_string(r) + ".err");
  }
  auto [masters, losses] = reference(world, 5, is_async);
  at::Tensor loss_sum;
  std::vector<at::Tensor> rank0;
  for (int64_t r = 0; r < world; ++r) {
    std::vector<at::Tensor> result = load_result(dir, r);
    const at::Tensor rank_losses = result.back();
    result.pop_back();
    loss_sum = loss_sum.defined() ? loss_sum + rank_losses : rank_losses;
    // The processes' sum comes in Gloo's order, not microbatch order: after
    // 5 Adam steps (which normalize small gradients) parameters differ by a
    // few fp32 ulps of the largest one.
    expect_all_close(result, masters, 4e-6, "parameters of rank " + std::to_string(r));
    if (r == 0) {
      rank0 = result;
    } else {
      for (size_t i = 0; i < result.size(); ++i)
        EXPECT_TRUE(result[i].equal(rank0[i])) << "rank " << r << " #" << i;
    }
  }
  // Each process returns the loss of its own microbatches.
  expect_all_close({loss_sum}, {at::stack(losses)}, 1e-6, "losses");
}

// With bf16 optimizer copies every process rounds the same fp32 sum of the
// processes' bf16 gradients, so the ranks stay bitwise equal. One process
// instead adds its microbatches' bf16 gradients with stochastic rounding, so
// it only tracks them: elements whose gradient is near 0 can step by lr
// either way (Adam normalizes them), so the measure is the mean distance
// against the mean movement of training.
TEST(DataParallel, TwoProcessesWithTheCompactStateStayEqualAndTrackOneProcess) {
  const std::string dir = temp_dir() + "/w2compact";
  const std::vector<Child> children = run_group(2, dir, {"ROUNDPIPE_DP_COMPACT=1"});
  for (int64_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(exited_ok(children[r]))
        << "rank " << r << ": " << read_text(dir + "/rank" + std::to_string(r) + ".err");
  }
  auto [masters, losses] = reference(2, 5, true, /*compact=*/true);
  std::vector<at::Tensor> rank0 = load_result(dir, 0), rank1 = load_result(dir, 1);
  const at::Tensor loss_sum = rank0.back() + rank1.back();
  rank0.pop_back();
  rank1.pop_back();
  expect_all_equal(rank1, rank0, "parameters of rank 1 against rank 0");
  for (const at::Tensor& p : rank0) {  // the model holds the bf16 copies' values
    EXPECT_TRUE(p.equal(p.to(at::kBFloat16).to(p.scalar_type())));
  }
  // What training moved, and how far the processes ended from one process.
  Trainer start(-1, nullptr, 2 * kMicrobatchesPerRank, /*compact=*/true);
  const std::vector<at::Tensor> initial = start.parameters();
  double moved = 0, apart = 0;
  int64_t n = 0;
  for (size_t i = 0; i < masters.size(); ++i) {
    moved += (masters[i] - initial[i]).abs().sum().item<double>();
    apart += (rank0[i] - masters[i]).abs().sum().item<double>();
    n += masters[i].numel();
  }
  // Measured: 0.029 moved per element on average, 3.6e-5 apart. A
  // reduction that dropped or doubled a process's share would leave them a
  // good part of the movement apart.
  EXPECT_GT(moved / n, 1e-2);
  EXPECT_LT(apart, 1e-2 * moved) << "mean distance " << apart / n << ", mean movement "
                                 << moved / n;
  // Step 1 runs before any update: its losses are the same sums.
  EXPECT_NEAR(loss_sum[0].item<double>(), losses[0].item<double>(), 1e-5);
  expect_all_close({loss_sum}, {at::stack(losses)}, 2e-2, "losses");
}

TEST(DataParallel, TwoProcessesAsyncEqualOneProcessOnTheWholeBatch) {
  expect_matches_one_process(2, true);
}
TEST(DataParallel, TwoProcessesSyncEqualOneProcessOnTheWholeBatch) {
  expect_matches_one_process(2, false);
}
TEST(DataParallel, ThreeProcessesAsyncEqualOneProcessOnTheWholeBatch) {
  expect_matches_one_process(3, true);
}
TEST(DataParallel, ThreeProcessesSyncEqualOneProcessOnTheWholeBatch) {
  expect_matches_one_process(3, false);
}

TEST(DataParallel, APeerKilledMidRunFailsTheOthersWithinTheTimeout) {
  const std::string dir = temp_dir() + "/kill";
  const std::vector<Child> children =
      run_group(3, dir, {"ROUNDPIPE_DP_DIE_AT=3", "ROUNDPIPE_DP_TIMEOUT_MS=15000"},
                std::chrono::seconds(120));
  ASSERT_TRUE(children[2].done && WIFSIGNALED(children[2].status));
  for (int64_t r = 0; r < 2; ++r) {
    const Child& c = children[r];
    ASSERT_TRUE(c.done && WIFEXITED(c.status)) << "rank " << r << " did not exit by itself";
    EXPECT_NE(WEXITSTATUS(c.status), 0) << "rank " << r;
    const std::string error = read_text(dir + "/rank" + std::to_string(r) + ".err");
    EXPECT_THAT(error, HasSubstr("data parallel: "));
    EXPECT_THAT(error, HasSubstr("rank " + std::to_string(r) + " of 3"));
    std::cout << "rank " << r << " ended " << c.seconds << " s after the start (timeout 15 s)\n";
  }
}

TEST(DataParallel, APeerThatHangsFailsTheOthersAfterTheTimeout) {
  const std::string dir = temp_dir() + "/hang";
  const std::vector<Child> children =
      run_group(2, dir, {"ROUNDPIPE_DP_HANG_AT=3", "ROUNDPIPE_DP_TIMEOUT_MS=2000"},
                std::chrono::seconds(120));
  ASSERT_TRUE(children[0].done && WIFEXITED(children[0].status)) << "rank 0 did not exit by itself";
  EXPECT_NE(WEXITSTATUS(children[0].status), 0);
  const std::string error = read_text(dir + "/rank0.err");
  EXPECT_THAT(error, HasSubstr("data parallel: "));
  EXPECT_THAT(error, HasSubstr("rank 0 of 2"));
  EXPECT_THAT(error, HasSubstr("timeout of 2 s"));
  std::cout << "rank 0 ended " << children[0].seconds
            << " s after the start (timeout 2 s; the peer slept "
            << "6 s and ended after " << children[1].seconds << " s)\n";
}

TEST(DataParallel, CheckpointOfTwoProcessesResumesInOne) {
  const std::string dir = temp_dir() + "/resume", path = dir + "/dp.ckpt";
  const std::vector<Child> children =
      run_group(2, dir, {"ROUNDPIPE_DP_STEPS=3", "ROUNDPIPE_DP_SAVE=" + path});
  for (int64_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(exited_ok(children[r]))
        << "rank " << r << ": " << read_text(dir + "/rank" + std::to_string(r) + ".err");
  }
  // One process, other initial weights and seed, continues at step 4 on the
  // concatenated batches.
  Trainer resumed(5, nullptr, 2 * kMicrobatchesPerRank);
  CheckpointState state;
  state.optimizer = &resumed.opt;
  load_checkpoint(path, resumed.model, state);
  EXPECT_EQ(state.step, 3);
  std::vector<at::Tensor> losses;
  for (int64_t k = 4; k <= 5; ++k) {
    auto [ids, targets] = global_batch(k, 2);
    losses.push_back(resumed.train_step(ids, targets, true));
  }
  auto [masters, reference_losses] = reference(2, 5, true);
  expect_all_close(resumed.parameters(), masters, 1e-6, "parameters after resuming");
  expect_all_close({at::stack(losses)}, {at::stack(reference_losses).narrow(0, 3, 2)}, 1e-6,
                   "losses 4 and 5");
}

TEST(DataParallel, BadOptionsAreValueErrors) {
  auto error_of = [](ProcessGroupOptions o) {
    return value_error_of([&] { ProcessGroup::create(o); });
  };
  EXPECT_THAT(error_of(ProcessGroupOptions().set_rank(2).set_world_size(2).set_init_method(
                  "file:///tmp/x")),
              HasSubstr("rank must be in 0..1"));
  EXPECT_THAT(error_of(ProcessGroupOptions().set_rank(0).set_world_size(0)),
              HasSubstr("world_size must be >= 1"));
  EXPECT_THAT(
      error_of(ProcessGroupOptions().set_rank(0).set_world_size(1).set_init_method("nccl://x")),
      HasSubstr("init_method must be"));
  EXPECT_THAT(
      error_of(ProcessGroupOptions().set_rank(0).set_world_size(1).set_init_method("tcp://host")),
      HasSubstr("tcp://HOST:PORT"));
  EXPECT_THAT(error_of(ProcessGroupOptions().set_rank(0).set_world_size(1).set_init_method(
                  "tcp://h:99999")),
              HasSubstr("port number"));
  EXPECT_THAT(error_of(ProcessGroupOptions().set_rank(0).set_world_size(1).set_timeout(
                  std::chrono::milliseconds(0))),
              HasSubstr("timeout must be positive"));
  ::unsetenv("RANK");
  EXPECT_THAT(error_of(ProcessGroupOptions().set_world_size(1)), HasSubstr("RANK is not set"));
}

TEST(DataParallel, OneProcessGroupServesOneModel) {
  const std::string store = temp_dir() + "/single_store";
  auto group = ProcessGroup::create(
      ProcessGroupOptions().set_rank(0).set_world_size(1).set_init_method("file://" + store));
  torch::manual_seed(0);
  RoundPipe first(make_mlp(), RoundPipeOptions().set_process_group(group));
  EXPECT_THAT(value_error_of([&] {
                RoundPipe second(make_mlp(), RoundPipeOptions().set_process_group(group));
              }),
              HasSubstr("already serves model"));
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
