// Faults around a model: every file write of a checkpoint failing in turn
// (ENOSPC, EIO, short writes, at each system call), interrupts during the
// write, calls from inside the model's own callbacks, one model driven from
// two threads, batches whose parts disagree, and a failing synchronous step.
// The invariant after each: no crash or hang, a clear error, the previous
// checkpoint loadable, no temporary file left, the model still training.
#include <gtest/gtest.h>
#include <roundpipe/checkpoint.h>
#include <roundpipe/optim/sgd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "engine/checkpoint_internal.h"
#include "expect_error.h"
#include "models.h"
#include "scratch_dir.h"
#include "util/atomic_file.h"
#include "util/interrupt.h"

namespace roundpipe {
namespace testing {
namespace {

std::string temp_dir() { return scratch_dir("roundpipe_faults_"); }

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<at::Tensor> values(const RoundPipe& model) {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : model.state_dict()) out.push_back(t.detach().clone());
  return out;
}

void expect_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << what << " #" << i;
}

// A small model trained with SGD and asynchronous steps.
struct Trainee {
  RoundPipe model;
  std::unique_ptr<optim::SGD> sgd;
  at::Tensor x = torch::randn({6, 16}), y = torch::randn({6, 4});
  int64_t steps = 0;

  explicit Trainee(uint64_t seed = 1)
      : model((torch::manual_seed(static_cast<int64_t>(seed)), make_mlp()),
              RoundPipeOptions().set_seed(seed).set_run_config(RunConfig().num_microbatch(3))) {
    sgd = std::make_unique<optim::SGD>(model.optim_parameters(), optim::SGDOptions(0.05));
  }
  ~Trainee() { model.synchronize(); }  // the steps queued use `sgd`, destroyed first
  void train(int64_t n = 1, bool is_async = true) {
    for (int64_t i = 0; i < n; ++i) {
      model.forward_backward({x}, make_kwargs(), y, mse_loss_fn());
      model.step([this] { sgd->step(), sgd->zero_grad(); }, is_async);
      ++steps;
    }
  }
  CheckpointState state() {
    CheckpointState s;
    s.optimizer = sgd.get();
    s.step = steps;
    return s;
  }
};

// The step a checkpoint at `path` holds, loaded into a fresh model.
int64_t saved_step(const std::string& path) {
  Trainee fresh(7);
  CheckpointState s = fresh.state();
  load_checkpoint(path, fresh.model, s);
  return s.step;
}

struct FileFaultGuard {
  ~FileFaultGuard() { set_file_fault_injector(nullptr); }
};

// Every system call of a save, each failing in turn with each error: the
// save throws (naming the file and the error) or, for a short write, goes
// on and succeeds; the directory then holds the old or the new checkpoint
// and nothing else, and the model trains on.
TEST(CheckpointFaults, EverySystemCallOfASaveFailingLeavesTheOldCheckpointAndTheModelTraining) {
  FileFaultGuard guard;
  const std::string dir = temp_dir() + "/every_call";
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  const std::string path = dir + "/model.ckpt";
  Trainee t;
  t.train(2);
  save_checkpoint(path, t.model, t.state());

  // The calls one save makes.
  std::vector<FileCall> calls;
  set_file_fault_injector([&](FileCall call, const std::string&) {
    calls.push_back(call);
    return 0;
  });
  save_checkpoint(path, t.model, t.state());
  set_file_fault_injector(nullptr);
  ASSERT_GE(calls.size(), 5u);  // create, writes, fsync, close, rename

  int64_t failed = 0;
  for (size_t at = 0; at < calls.size(); ++at) {
    std::vector<int> faults = {ENOSPC, EIO};
    if (calls[at] == FileCall::kWrite) faults.push_back(kShortWrite);
    for (int fault : faults) {
      SCOPED_TRACE("call " + std::to_string(at) + ", fault " + std::to_string(fault));
      const int64_t before = saved_step(path);
      t.train(1);
      size_t seen = 0;
      set_file_fault_injector([&](FileCall, const std::string&) { return seen++ == at ? fault : 0; });
      std::string error;
      try {
        save_checkpoint(path, t.model, t.state());
      } catch (const c10::Error& e) {
        error = e.what_without_backtrace();
      }
      set_file_fault_injector(nullptr);
      if (fault == kShortWrite) {
        EXPECT_EQ(error, "") << "a short write is retried";
        EXPECT_EQ(saved_step(path), t.steps);
      } else {
        ++failed;
        EXPECT_NE(error.find("save_checkpoint"), std::string::npos) << error;
        EXPECT_NE(error.find(path), std::string::npos) << error;
        EXPECT_NE(error.find(std::strerror(fault)), std::string::npos) << error;
        EXPECT_EQ(saved_step(path), before) << "the previous checkpoint is not the one in place";
      }
      EXPECT_EQ(entries(dir), std::vector<std::string>{"model.ckpt"}) << "a temporary file was left";
    }
  }
  EXPECT_EQ(failed, 2 * static_cast<int64_t>(calls.size()));
  // Still training, and a save works again.
  t.train(2);
  save_checkpoint(path, t.model, t.state());
  EXPECT_EQ(saved_step(path), t.steps);
}

// Interrupted while writing (the poll of an InterruptScope, as Python's
// Ctrl-C): the interrupt is rethrown, no file is left, nothing aborts.
TEST(CheckpointFaults, AnInterruptDuringTheWriteLeavesNoFile) {
  const std::string dir = temp_dir() + "/interrupt";
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  const std::string path = dir + "/model.ckpt";
  Trainee t;
  t.train(1);
  struct Interrupted : std::runtime_error {
    Interrupted() : std::runtime_error("interrupted") {}
  };
  // The interrupt comes once the archive is being written: its first write
  // sleeps past the poll period, so the next one polls.
  std::atomic<int64_t> writes{0};
  std::atomic<bool> armed{false};
  detail::set_checkpoint_crash_hook([&](const char* point, uint64_t) {
    if (std::strcmp(point, "write") == 0 && writes++ == 1) {
      armed = true;
      std::this_thread::sleep_for(kInterruptPollPeriod + std::chrono::milliseconds(20));
    }
  });
  bool thrown = false;
  {
    InterruptScope scope([&]() -> std::exception_ptr {
      if (!armed) return nullptr;
      return std::make_exception_ptr(Interrupted());
    });
    try {
      save_checkpoint(path, t.model, t.state());
    } catch (const Interrupted&) {
      thrown = true;
    }
  }
  detail::set_checkpoint_crash_hook(nullptr);
  EXPECT_TRUE(thrown);
  EXPECT_GE(writes.load(), 2);
  EXPECT_TRUE(entries(dir).empty()) << "an interrupted save left a file";
  t.train(1);
  save_checkpoint(path, t.model, t.state());
  EXPECT_EQ(saved_step(path), t.steps);
}

TEST(CheckpointFaults, ASymlinkIsWrittenThroughAndStaleTemporaryFilesGo) {
  const std::string dir = temp_dir() + "/links";
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((dir + "/runs").c_str(), 0755), 0);
  ASSERT_EQ(::symlink("runs/target.ckpt", (dir + "/latest.ckpt").c_str()), 0);
  // What a process killed during its save leaves (pid 1 runs forever; a pid
  // beyond pid_max never ran).
  const std::string dead = dir + "/runs/target.ckpt.tmp.4194305.0";
  const std::string alive = dir + "/runs/target.ckpt.tmp.1.0";
  for (const std::string& f : {dead, alive}) write_file_atomically(f, "partial");
  Trainee t;
  t.train(1);
  save_checkpoint(dir + "/latest.ckpt", t.model, t.state());
  struct stat st;
  ASSERT_EQ(::lstat((dir + "/latest.ckpt").c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode)) << "the link was replaced";
  EXPECT_EQ(saved_step(dir + "/runs/target.ckpt"), 1);
  EXPECT_EQ(entries(dir + "/runs"), (std::vector<std::string>{"target.ckpt", "target.ckpt.tmp.1.0"}));
}

// ---- calls from inside the model's own callbacks ----

TEST(ModelUse, CallsFromInsideAStepFnAreClearErrorsNotDeadlocks) {
  const std::string path = temp_dir() + "/from_step_fn.ckpt";
  for (bool is_async : {false, true}) {
    SCOPED_TRACE(is_async ? "asynchronous" : "synchronous");
    Trainee t;
    t.train(1);
    t.model.forward_backward({t.x}, make_kwargs(), t.y, mse_loss_fn());
    std::vector<std::string> errors;
    auto attempt = [&](const std::function<void()>& f) {
      try {
        f();
        errors.push_back("");
      } catch (const c10::Error& e) {
        errors.push_back(e.what_without_backtrace());
      }
    };
    auto step_fn = [&] {
      attempt([&] { save_checkpoint(path, t.model, t.state()); });
      attempt([&] { t.model.synchronize(); });
      attempt([&] { t.model.forward_backward({t.x}, make_kwargs(), t.y, mse_loss_fn()); });
      attempt([&] { t.model.step([] {}); });
      attempt([&] { t.model.load_state_dict(t.model.state_dict()); });
      EXPECT_FALSE(t.model.parameters().empty());  // what a step_fn may read
      t.sgd->step();
      t.sgd->zero_grad();
    };
    t.model.step(step_fn, is_async);
    t.model.synchronize();
    const std::vector<std::string> calls = {"save_checkpoint()", "synchronize()", "forward_backward()",
                                            "step()", "load_state_dict()"};
    ASSERT_EQ(errors.size(), calls.size());
    for (size_t i = 0; i < calls.size(); ++i) {
      expect_message(errors[i], {calls[i], "inside the step_fn of model", "model.step(...) returns"});
    }
    t.train(1);  // still training
  }
}

// A layer that passes its input on after calling `fn` with it.
struct CallsBackImpl : torch::nn::Cloneable<CallsBackImpl>, ValueLayer {
  explicit CallsBackImpl(std::function<void(const at::Tensor&)> fn) : fn(std::move(fn)) {}
  void reset() override {}
  c10::IValue forward(std::vector<c10::IValue> args, Kwargs) override {
    fn(args.at(0).toTensor());
    return args.at(0);
  }
  std::function<void(const at::Tensor&)> fn;
};
TORCH_MODULE(CallsBack);

TEST(ModelUse, CallsFromInsideALossFnOrALayerAreClearErrors) {
  Trainee t;
  std::string from_loss;
  LossFn loss = [&](const c10::IValue& out, const c10::IValue& label) -> c10::IValue {
    try {
      t.model.synchronize();
    } catch (const c10::Error& e) {
      from_loss = e.what_without_backtrace();
    }
    return mse_loss_fn()(out, label);
  };
  t.model.forward_backward({t.x}, make_kwargs(), t.y, loss);
  t.model.synchronize();
  expect_message(from_loss, {"synchronize()", "inside the loss_fn of model 'roundpipe'", "a device thread"});

  // A layer whose forward calls its own model.
  RoundPipe* self = nullptr;
  std::string from_layer;
  torch::nn::Sequential net(torch::nn::Linear(4, 4), CallsBack([&](const at::Tensor& x) {
                              try {
                                self->forward_backward({x}, make_kwargs(), x, mse_loss_fn());
                              } catch (const c10::Error& e) {
                                from_layer = e.what_without_backtrace();
                              }
                            }));
  RoundPipe model(net, RoundPipeOptions().set_run_config(RunConfig().num_microbatch(2)));
  self = &model;
  model.forward_backward({torch::randn({4, 4})}, make_kwargs(), torch::randn({4, 4}), mse_loss_fn());
  model.synchronize();
  expect_message(from_layer, {"forward_backward()", "layer 1 of model"});
}

// One model, two threads, each its own loop: calls are serialized, none
// waits forever, and the steps all happen.
TEST(ModelUse, TwoThreadsDrivingOneModelFinish) {
  Trainee t;
  int64_t steps_run = 0;
  auto loop = [&] {
    for (int i = 0; i < 15; ++i) {
      t.model.forward_backward({t.x}, make_kwargs(), t.y, mse_loss_fn());
      t.model.step([&] { ++steps_run, t.sgd->step(), t.sgd->zero_grad(); }, i % 3 != 0);
      if (i % 5 == 0) t.model.state_dict();
    }
  };
  std::thread a(loop), b(loop);
  a.join();
  b.join();
  t.model.synchronize();
  EXPECT_EQ(steps_run, 30);
  for (const at::Tensor& v : values(t.model)) EXPECT_TRUE(v.isfinite().all().item<bool>());
}

// ---- batches whose parts disagree ----

// Two positional inputs.
struct AddPairImpl : torch::nn::Cloneable<AddPairImpl>, ValueLayer {
  AddPairImpl() { reset(); }
  void reset() override { w = register_parameter("w", torch::ones({4})); }
  c10::IValue forward(std::vector<c10::IValue> args, Kwargs) override {
    return (args.at(0).toTensor() + args.at(1).toTensor()) * w;
  }
  at::Tensor w;
};
TORCH_MODULE(AddPair);

TEST(ModelUse, InputsAndLabelsOfDifferentBatchSizesAreValueErrors) {
  Trainee t;
  const auto before = values(t.model);
  expect_message(value_error_of([&] {
                   t.model.forward_backward({torch::randn({6, 16})}, make_kwargs(), torch::randn({3, 4}),
                                            mse_loss_fn());
                 }),
                 {"label has 3 rows", "the inputs has 6", "share their batch size"});
  torch::nn::Sequential two(AddPair{});
  RoundPipe pair(two, RoundPipeOptions().set_run_config(RunConfig().num_microbatch(2)));
  expect_message(value_error_of([&] { pair.forward({torch::randn({6, 4}), torch::randn({5, 4})}); }),
                 {"args[1] has 5 rows", "args[0] has 6"});
  t.model.synchronize();
  expect_equal(values(t.model), before, "a refused call changed the model");
  t.train(1);
}

// ---- a failing synchronous step ----

TEST(ModelUse, AFailedSynchronousStepLeavesTheLastSuccessfulStepInTheModel) {
  Trainee t;
  t.train(2, /*is_async=*/true);  // the model one step behind the copies
  t.model.forward_backward({t.x}, make_kwargs(), t.y, mse_loss_fn());
  std::vector<at::Tensor> last;  // θ_2: the copies before the failing step_fn
  EXPECT_THROW(t.model.step(
                   [&] {
                     for (const at::Tensor& p : t.model.optim_parameters()) last.push_back(p.detach().clone());
                     t.sgd->step();  // changes the copies, then fails
                     throw std::runtime_error("the step fails");
                   },
                   /*is_async=*/false),
               std::runtime_error);
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : t.model.parameters()) params.push_back(p.detach().clone());
  expect_equal(params, last, "right after the failed step");
  t.model.synchronize();
  params.clear();
  for (const at::Tensor& p : t.model.parameters()) params.push_back(p.detach().clone());
  expect_equal(params, last, "after synchronize");
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe

namespace roundpipe {
namespace testing {
namespace {

// A master parameter changed in place from outside (the wrapped model's own
// load, an in-place op) is taken into its optimizer copy before the next
// step instead of being overwritten by the stale copy.
TEST(ModelUse, AParameterChangedFromOutsideIsNotUndoneByTheNextStep) {
  for (bool is_async : {true, false}) {
    SCOPED_TRACE(is_async ? "asynchronous" : "synchronous");
    torch::manual_seed(3);
    torch::nn::Sequential net = make_mlp();
    RoundPipe model(net, RoundPipeOptions().set_run_config(RunConfig().num_microbatch(2)));
    optim::SGD sgd(model.optim_parameters(), optim::SGDOptions(0.0));  // steps change nothing
    const at::Tensor x = torch::randn({4, 16}), y = torch::randn({4, 4});
    auto train = [&] {
      model.forward_backward({x}, make_kwargs(), y, mse_loss_fn());
      model.step([&] { sgd.step(), sgd.zero_grad(); }, is_async);
    };
    train();
    train();
    model.synchronize();
    {
      torch::NoGradGuard no_grad;
      net->parameters()[0].fill_(0.25);  // through the wrapped model
    }
    train();
    train();
    model.synchronize();
    EXPECT_TRUE(net->parameters()[0].eq(0.25).all().item<bool>()) << "the step undid the change";
    EXPECT_TRUE(model.optim_parameters()[0].eq(0.25).all().item<bool>());
  }
}

}  // namespace
}  // namespace testing
}  // namespace roundpipe
