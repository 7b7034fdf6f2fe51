// Bad-input catalog, the C++ counterpart of
// tests/python/test_bad_input_catalog.py: for every public entry point, each
// invalid argument gets a c10::Error of the right type whose message names
// the entry point and what was wrong; nothing crashes or hangs; no state
// changes; and the object works afterwards.
//
// Two tables, one row per case (entry point, invalid argument, expected
// type, message fragments):
//  - kModelCases run against a RoundPipe with an Adam optimizer, one step
//    taken and gradients pending. After the bad call its parameters,
//    gradients (pending ones included), buffers, optimizer copies and
//    optimizer state must equal bitwise those of an identical model that
//    never saw the bad call, and one more training iteration must give both
//    the same results again.
//  - Free cases build their own objects; an optional `after` checks that the
//    object is unchanged and still usable.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

#include "util/file_error.h"
#include "engine/engine_access.h"
#include "models.h"
#include "roundpipe/optim/adam.h"
#include "roundpipe/optim/sgd.h"
#include "scratch_dir.h"

namespace roundpipe {
namespace testing {
namespace {

// The exception type a case expects.
enum class Kind {
  kValue,  // c10::ValueError (Python ValueError)
  kType,   // c10::TypeError (Python TypeError)
  kIndex,  // c10::IndexError (Python IndexError)
  kError,  // plain c10::Error (Python RuntimeError): failing system calls, misuse
  kStd,    // the user's own std::invalid_argument, passed through with context
};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kValue: return "c10::ValueError";
    case Kind::kType: return "c10::TypeError";
    case Kind::kIndex: return "c10::IndexError";
    case Kind::kError: return "c10::Error";
    case Kind::kStd: return "std::invalid_argument";
  }
  return "?";
}

// Runs `call`, which must throw an exception of `kind` whose message holds
// every fragment. Returns "" when it did, else what went wrong.
std::string check_throws(const std::function<void()>& call, Kind kind, const std::vector<std::string>& fragments) {
  std::string message;
  try {
    call();
    return "no exception";
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
    const bool ok = kind == Kind::kValue   ? dynamic_cast<const c10::ValueError*>(&e) != nullptr
                    : kind == Kind::kType  ? dynamic_cast<const c10::TypeError*>(&e) != nullptr
                    : kind == Kind::kIndex ? dynamic_cast<const c10::IndexError*>(&e) != nullptr
                    // A failed file operation is a c10::Error carrying its errno.
                    : kind == Kind::kError ? typeid(e) == typeid(c10::Error) || typeid(e) == typeid(FileError)
                                           : false;
    if (!ok) return std::string(typeid(e).name()) + " instead of " + kind_name(kind) + ": " + message;
  } catch (const std::invalid_argument& e) {
    message = e.what();
    if (kind != Kind::kStd) return std::string("std::invalid_argument instead of ") + kind_name(kind) + ": " + message;
  } catch (const std::exception& e) {
    return std::string(typeid(e).name()) + " instead of " + kind_name(kind) + ": " + e.what();
  }
  for (const std::string& f : fragments) {
    if (message.find(f) == std::string::npos) return "message lacks '" + f + "': " + message;
  }
  return "";
}

std::string temp_dir() { return scratch_dir("roundpipe_badin_"); }

std::string temp_path(const std::string& name) { return temp_dir() + "/" + name; }

void write_bytes(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

// ---------------------------------------------------------------------------
// Model-level cases

// Linear | BatchNorm (buffers) | Tanh | Linear; a fixed plan and microbatch
// count, so that the reference model runs exactly the same computation.
torch::nn::Sequential catalog_net() {
  return torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8), torch::nn::Tanh(),
                               torch::nn::Linear(8, 4));
}

// For forward(): a plan of two forward and two backward stages.
RunConfig train_plan() { return RunConfig().execute_plan(ModelExecutePlan{{{0, 2}, {2, 4}}, {{2, 4}, {0, 2}}}); }

RunConfig catalog_config() {
  return RunConfig().num_microbatch(3).execute_plan(ModelExecutePlan{{{0, 2}}, {{2, 4}, {0, 2}}});
}

struct ModelFixture {
  ModelFixture()
      : net((torch::manual_seed(0), catalog_net())),
        model(net, RoundPipeOptions().set_name("catalog").set_max_devices(2).set_seed(7).set_run_config(
                       catalog_config())),
        opt(model.optim_parameters(), optim::AdamOptions(1e-2)),
        x(torch::randn({6, 8})),
        y(torch::randn({6, 4})) {
    iterate();
    model.forward_backward({x}, make_kwargs(), y, loss_fn, false);  // gradients pending
  }

  // One training iteration with a synchronous step.
  at::Tensor iterate() {
    at::Tensor loss = model.forward_backward({x}, make_kwargs(), y, loss_fn, false).toTensor();
    model.step(
        [this] {
          opt.step();
          opt.zero_grad();
        },
        /*is_async=*/false);
    return loss;
  }

  // Everything a failed call must leave alone, by name (copies). Pending
  // gradients reach .grad through synchronize().
  std::vector<std::pair<std::string, at::Tensor>> snapshot() {
    model.synchronize();
    std::vector<std::pair<std::string, at::Tensor>> out;
    auto add = [&](const std::string& name, const at::Tensor& t) {
      out.emplace_back(name, t.defined() ? t.detach().clone() : at::Tensor());
    };
    for (const auto& item : net->named_parameters()) {
      add("param " + item.key(), item.value());
      add("grad " + item.key(), item.value().grad());
    }
    for (const auto& item : net->named_buffers()) add("buffer " + item.key(), item.value());
    for (const auto& [name, t] : model.optim_named_parameters()) {
      add("copy " + name, t);
      add("copy grad " + name, t.grad());
      auto it = opt.state().find(t.unsafeGetTensorImpl());
      if (it == opt.state().end()) continue;
      const auto& s = static_cast<const torch::optim::AdamParamState&>(*it->second);
      add("adam exp_avg " + name, s.exp_avg());
      add("adam exp_avg_sq " + name, s.exp_avg_sq());
      add("adam step " + name, torch::tensor(s.step()));
    }
    return out;
  }

  LossFn loss_fn = mse_loss_fn();
  torch::nn::Sequential net;
  RoundPipe model;
  optim::Adam opt;
  at::Tensor x, y;
};

// "" when equal bitwise, else the first difference.
std::string compare(const std::vector<std::pair<std::string, at::Tensor>>& a,
                    const std::vector<std::pair<std::string, at::Tensor>>& b) {
  if (a.size() != b.size()) return "different number of tensors: " + std::to_string(a.size()) + " vs " +
                                   std::to_string(b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first) return "different names: " + a[i].first + " vs " + b[i].first;
    const at::Tensor &s = a[i].second, &t = b[i].second;
    if (s.defined() != t.defined()) return a[i].first + " defined in one only";
    if (s.defined() && (s.scalar_type() != t.scalar_type() || !at::equal(s, t))) return a[i].first + " differs";
  }
  return "";
}

// Saves a checkpoint of a model of another architecture (last layer 8 -> 5).
std::string other_architecture_checkpoint() {
  const std::string path = temp_path("other.ckpt");
  torch::nn::Sequential other(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8), torch::nn::Tanh(),
                              torch::nn::Linear(8, 5));
  RoundPipe model(other, RoundPipeOptions().set_max_devices(1));
  save_checkpoint(path, model, CheckpointState());
  return path;
}

// A checkpoint of the catalog model without optimizer or scaler state.
std::string plain_checkpoint() {
  const std::string path = temp_path("plain.ckpt");
  torch::manual_seed(1);
  RoundPipe model(catalog_net(), RoundPipeOptions().set_max_devices(1));
  save_checkpoint(path, model, CheckpointState());
  return path;
}

struct ModelCase {
  const char* entry;
  const char* bad;
  Kind kind;
  std::vector<std::string> fragments;
  std::function<void(ModelFixture&)> call;
};

using NT = std::vector<std::pair<std::string, at::Tensor>>;

// A state dict for the model with every entry changed (so that a partial
// load would show), `name` replaced by `value` or, with `remove`, left out.
NT state_with(ModelFixture& f, const std::string& name, at::Tensor value, bool remove = false) {
  NT out;
  for (auto& [n, t] : f.model.state_dict()) {
    if (n != name) {
      out.emplace_back(n, t.detach() + 1);
    } else if (!remove) {
      out.emplace_back(n, value);
    }
  }
  return out;
}

const std::vector<ModelCase>& model_cases() {
  static const std::vector<ModelCase> cases = [] {
    auto fb = [](ModelFixture& f, const RunConfig& cfg) {
      f.model.forward_backward({f.x}, make_kwargs(), f.y, f.loss_fn, false, cfg);
    };
    auto fb_with = [](ModelFixture& f, std::vector<c10::IValue> args, c10::IValue label, const LossFn& loss) {
      f.model.forward_backward(std::move(args), make_kwargs(), std::move(label), loss, false);
    };
    using K = Kind;
    return std::vector<ModelCase>{
        {"forward_backward", "loss_fn empty", K::kValue, {"forward_backward", "loss_fn is empty"},
         [=](ModelFixture& f) { fb_with(f, {f.x}, f.y, LossFn()); }},
        {"forward_backward", "num_microbatch 0", K::kValue,
         {"forward_backward", "catalog", "num_microbatch must be >= 1, got 0"},
         [=](ModelFixture& f) { fb(f, RunConfig().num_microbatch(0)); }},
        {"forward_backward", "num_microbatch -2", K::kValue, {"forward_backward", "got -2"},
         [=](ModelFixture& f) { fb(f, RunConfig().num_microbatch(-2)); }},
        {"forward_backward", "empty backward plan", K::kValue, {"forward_backward", "backward plan is empty"},
         [=](ModelFixture& f) { fb(f, RunConfig().execute_plan({{{0, 2}}, {}})); }},
        {"forward_backward", "plan ranges overlap", K::kValue, {"forward_backward", "exactly once"},
         [=](ModelFixture& f) { fb(f, RunConfig().execute_plan({{{0, 2}}, {{2, 4}, {1, 3}, {0, 1}}})); }},
        {"forward_backward", "plan range past the last layer", K::kValue, {"forward_backward", "range(0, 99)"},
         [=](ModelFixture& f) { fb(f, RunConfig().execute_plan({{{0, 99}}, {{99, 100}}})); }},
        {"forward_backward", "fused stage not where forward ends", K::kValue,
         {"forward_backward", "forward plan must end exactly where the fused stage begins"},
         [=](ModelFixture& f) { fb(f, RunConfig().execute_plan({{{0, 1}}, {{2, 4}, {0, 2}}})); }},
        {"forward_backward", "input of the wrong width", K::kError,
         {"RoundPipe model 'catalog'", "layer 0", "microbatch 0"},
         [=](ModelFixture& f) { fb_with(f, {torch::randn({6, 5})}, f.y, f.loss_fn); }},
        {"forward_backward", "no positional argument", K::kType, {"RoundPipe model 'catalog'", "layer 0"},
         [=](ModelFixture& f) { fb_with(f, {}, f.y, f.loss_fn); }},
        {"forward_backward", "a string for the input", K::kType, {"RoundPipe model 'catalog'", "layer 0"},
         [=](ModelFixture& f) { fb_with(f, {c10::IValue("x")}, f.y, f.loss_fn); }},
        {"forward_backward", "empty batch", K::kValue, {"forward_backward", "the batch is empty"},
         [=](ModelFixture& f) { fb_with(f, {torch::randn({0, 8})}, torch::randn({0, 4}), f.loss_fn); }},
        {"forward_backward", "label with fewer rows than microbatches", K::kValue,
         {"forward_backward", "label has 2 rows"},
         [=](ModelFixture& f) { fb_with(f, {f.x}, torch::randn({2, 4}), f.loss_fn); }},
        {"forward_backward", "loss_fn returns a string", K::kType, {"loss_fn", "String"},
         [=](ModelFixture& f) {
           fb_with(f, {f.x}, f.y, [](const c10::IValue&, const c10::IValue&) { return c10::IValue("no"); });
         }},
        {"forward_backward", "loss_fn returns a non-scalar tensor", K::kValue,
         {"loss_fn", "scalar", "[2, 4]"},
         [=](ModelFixture& f) {
           fb_with(f, {f.x}, f.y, [](const c10::IValue& out, const c10::IValue&) { return out; });
         }},
        {"forward_backward", "loss_fn returns a constant", K::kValue, {"loss_fn", "does not require grad"},
         [=](ModelFixture& f) {
           fb_with(f, {f.x}, f.y, [](const c10::IValue&, const c10::IValue&) { return c10::IValue(torch::zeros({})); });
         }},
        {"forward_backward", "loss_fn throws", K::kStd, {"loss_fn says no", "RoundPipe model 'catalog'"},
         [=](ModelFixture& f) {
           fb_with(f, {f.x}, f.y, [](const c10::IValue&, const c10::IValue&) -> c10::IValue {
             throw std::invalid_argument("loss_fn says no");
           });
         }},
        {"forward_backward", "args_spec of the wrong length", K::kValue, {"forward_backward", "args_spec"},
         [=](ModelFixture& f) {
           InputSplit split;
           split.args_spec = std::vector<Spec>{Spec(), Spec()};
           fb(f, RunConfig().split_input(split));
         }},
        {"forward_backward", "TensorChunkSpec dim out of range", K::kValue,
         {"forward_backward", "TensorChunkSpec(3)"},
         [=](ModelFixture& f) {
           InputSplit split;
           split.args_spec = std::vector<Spec>{TensorChunkSpec(3)};
           fb(f, RunConfig().split_input(split));
         }},
        {"forward_backward", "split_input fn returns too few microbatches", K::kValue,
         {"forward_backward", "split_input function returned 1"},
         [=](ModelFixture& f) {
           InputSplit split;
           split.fn = [](const std::vector<c10::IValue>& args, const Kwargs& kwargs, int64_t) {
             return MicrobatchInputs{{args}, {kwargs}};
           };
           fb(f, RunConfig().split_input(split));
         }},
        {"forward_backward", "split_label fn returns too many labels", K::kValue,
         {"forward_backward", "split_label function returned 4"},
         [=](ModelFixture& f) {
           LabelSplit split;
           split.fn = [](const c10::IValue& label, int64_t n) { return std::vector<c10::IValue>(n + 1, label); };
           fb(f, RunConfig().split_label(split));
         }},
        {"forward_backward", "merge spec that does not fit the outputs", K::kValue,
         {"forward_backward", "merge_outputs", "tuple"},
         [](ModelFixture& f) {
           OutputMerge merge;
           merge.spec = Spec::tuple({Spec()});
           f.model.forward_backward({f.x}, make_kwargs(), f.y, f.loss_fn, /*return_outputs=*/true,
                                    RunConfig().merge_output(merge));
         }},
        {"forward_backward", "loss_fn returns lists of different lengths", K::kValue,
         {"forward_backward", "loss_fn returned sequences of different lengths"},
         [=](ModelFixture& f) {
           auto calls = std::make_shared<std::atomic<int>>(0);
           fb_with(f, {f.x}, f.y, [calls](const c10::IValue& out, const c10::IValue& y) {
             at::Tensor l = torch::mse_loss(out.toTensor(), y.toTensor());
             c10::List<at::Tensor> losses({l});
             if ((*calls)++ > 0) losses.push_back(l * 2);
             return c10::IValue(losses);
           });
         }},
        {"forward", "merge spec that does not fit the outputs", K::kValue, {"forward", "merge_outputs", "tuple"},
         [](ModelFixture& f) {
           OutputMerge merge;
           merge.spec = Spec::tuple({Spec()});
           f.model.forward(f.x, train_plan().merge_output(merge));
         }},
        {"forward", "num_microbatch 0", K::kValue, {"forward", "catalog", "num_microbatch must be >= 1, got 0"},
         [](ModelFixture& f) { f.model.forward(f.x, train_plan().num_microbatch(0)); }},
        {"forward", "plan that misses the last layer", K::kValue, {"forward", "last layer"},
         [](ModelFixture& f) { f.model.forward(f.x, RunConfig().execute_plan({{{0, 3}}, {}}).requires_grad(false)); }},
        {"forward", "integer input", K::kError, {"RoundPipe model 'catalog'", "layer 0"},
         [](ModelFixture& f) { f.model.forward(torch::ones({6, 8}, torch::kLong), train_plan()); }},
        {"forward", "kwargs for a tensor layer", K::kType, {"RoundPipe model 'catalog'", "layer 0", "keyword"},
         [](ModelFixture& f) { f.model.forward({f.x}, make_kwargs({{"mask", f.x}}), train_plan()); }},
        {"step", "step_fn empty", K::kValue, {"step", "step_fn is empty"},
         [](ModelFixture& f) { f.model.step(StepFn(), false); }},
        {"load_state_dict", "unknown name", K::kValue, {"load_state_dict", "unexpected", "bogus"},
         [](ModelFixture& f) {
           NT s = state_with(f, "", at::Tensor());
           s.emplace_back("bogus", torch::zeros({1}));
           f.model.load_state_dict(s);
         }},
        {"load_state_dict", "missing name", K::kValue, {"load_state_dict", "missing", "3.bias"},
         [](ModelFixture& f) { f.model.load_state_dict(state_with(f, "3.bias", at::Tensor(), true)); }},
        {"load_state_dict", "wrong shape", K::kValue, {"load_state_dict", "'3.weight' has shape [4, 9]"},
         [](ModelFixture& f) { f.model.load_state_dict(state_with(f, "3.weight", torch::zeros({4, 9}))); }},
        {"load_state_dict", "wrong shape, not strict", K::kValue, {"load_state_dict", "'3.weight' has shape"},
         [](ModelFixture& f) {
           f.model.load_state_dict({{"3.weight", torch::zeros({4, 9})}}, /*strict=*/false);
         }},
        {"load_state_dict", "undefined tensor", K::kValue, {"load_state_dict", "'3.bias'", "undefined"},
         [](ModelFixture& f) { f.model.load_state_dict(state_with(f, "3.bias", at::Tensor())); }},
        {"load_state_dict", "tensor without data (meta)", K::kValue, {"load_state_dict", "'3.bias'", "meta"},
         [](ModelFixture& f) {
           f.model.load_state_dict(state_with(f, "3.bias", torch::zeros({4}, torch::Device(torch::kMeta))));
         }},
        {"load_state_dict", "non-numeric dtype (complex)", K::kType, {"load_state_dict", "'3.bias'", "ComplexFloat"},
         [](ModelFixture& f) {
           f.model.load_state_dict(state_with(f, "3.bias", torch::zeros({4}, torch::kComplexFloat)));
         }},
        {"load_state_dict", "duplicated name", K::kValue, {"load_state_dict", "'3.bias'", "more than once"},
         [](ModelFixture& f) {
           NT s = state_with(f, "", at::Tensor());
           s.emplace_back("3.bias", torch::zeros({4}));
           f.model.load_state_dict(s);
         }},
        {"load_checkpoint", "missing file", K::kValue, {"load_checkpoint", "absent.ckpt"},
         [](ModelFixture& f) {
           CheckpointState s;
           load_checkpoint(temp_path("absent.ckpt"), f.model, s);
         }},
        {"load_checkpoint", "garbage file", K::kValue, {"load_checkpoint", "garbage.ckpt", "not a valid"},
         [](ModelFixture& f) {
           write_bytes(temp_path("garbage.ckpt"), std::string(100, 'x'));
           CheckpointState s;
           s.optimizer = &f.opt;
           load_checkpoint(temp_path("garbage.ckpt"), f.model, s);
         }},
        {"load_checkpoint", "another architecture", K::kValue, {"load_checkpoint", "other.ckpt", "3.weight"},
         [](ModelFixture& f) {
           CheckpointState s;
           s.optimizer = &f.opt;
           load_checkpoint(other_architecture_checkpoint(), f.model, s);
         }},
        {"load_checkpoint", "optimizer requested, none saved", K::kValue, {"load_checkpoint", "optimizer"},
         [](ModelFixture& f) {
           CheckpointState s;
           s.optimizer = &f.opt;
           load_checkpoint(plain_checkpoint(), f.model, s);
         }},
        {"load_checkpoint", "scaler requested, none saved", K::kValue, {"load_checkpoint", "GradScaler"},
         [](ModelFixture& f) {
           GradScaler scaler;
           CheckpointState s;
           s.scaler = &scaler;
           load_checkpoint(plain_checkpoint(), f.model, s);
         }},
        {"save_checkpoint", "directory missing", K::kError, {"cannot create", "no/such/dir/c.ckpt"},
         [](ModelFixture& f) { save_checkpoint(temp_path("no/such/dir/c.ckpt"), f.model, CheckpointState()); }},
        {"save_checkpoint", "empty path", K::kValue, {"save_checkpoint", "path is empty"},
         [](ModelFixture& f) { save_checkpoint("", f.model, CheckpointState()); }},
        {"auto_execute_plans", "upper_threshold < 1", K::kValue, {"auto_plan", "upper_threshold"},
         [](ModelFixture& f) { auto_execute_plans({&f.model}, AutoPlanOptions().set_upper_threshold(0.5)); }},
        {"auto_execute_plans", "a null model", K::kValue, {"auto_execute_plans", "null"},
         [](ModelFixture& f) { auto_execute_plans({&f.model, nullptr}, AutoPlanOptions()); }},
        {"save_timings", "directory missing", K::kError, {"save_timings", "no/such/dir"},
         [](ModelFixture& f) { save_timings(temp_path("no/such/dir/t.json"), {&f.model}); }},
        {"save_timings", "a null model", K::kValue, {"save_timings", "null"},
         [](ModelFixture& f) { save_timings(temp_path("t.json"), {&f.model, nullptr}); }},
    };
  }();
  return cases;
}

TEST(BadInputCatalog, ModelEntryPointsRejectBadInputAndChangeNothing) {
  for (const ModelCase& c : model_cases()) {
    SCOPED_TRACE(std::string(c.entry) + "(" + c.bad + ")");
    ModelFixture f, reference;
    const std::string problem = check_throws([&] { c.call(f); }, c.kind, c.fragments);
    EXPECT_EQ(problem, "");
    // Nothing changed: the same state as a model that never saw the call.
    EXPECT_EQ(compare(f.snapshot(), reference.snapshot()), "") << "after the failed call";
    // Still usable: one more iteration gives the reference's results.
    at::Tensor loss = f.iterate(), expected = reference.iterate();
    EXPECT_TRUE(at::equal(loss, expected)) << "loss after the failed call";
    EXPECT_EQ(compare(f.snapshot(), reference.snapshot()), "") << "after one more iteration";
  }
}

// ---------------------------------------------------------------------------
// Free-standing entry points

struct Case {
  std::string entry;
  std::string bad;
  Kind kind;
  std::vector<std::string> fragments;
  std::function<void()> call;
  std::function<void()> after = nullptr;  // the object unchanged and usable
};

// A module that is not cloneable (RoundPipe needs a replica per device).
struct PlainModule : torch::nn::Module {
  at::Tensor forward(at::Tensor x) { return x; }
};

// A layer whose parameter has no data on the CPU.
struct MetaParamImpl : torch::nn::Cloneable<MetaParamImpl> {
  MetaParamImpl() { reset(); }
  void reset() override { w = register_parameter("w", torch::zeros({2}, torch::Device(torch::kMeta))); }
  at::Tensor forward(at::Tensor x) { return x; }
  at::Tensor w;
};
TORCH_MODULE(MetaParam);

LayerCosts costs_of(int64_t n) {
  LayerCosts c;
  c.fwd_ms.assign(n, 1.0);
  c.recompute_ms.assign(n, 1.0);
  c.bwd_ms.assign(n, 2.0);
  c.param_bytes.assign(n, 100);
  return c;
}

DecoderConfig tiny_config() {
  DecoderConfig c = tiny_llama_config();
  c.hidden_size = 16;
  c.intermediate_size = 32;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.vocab_size = 32;
  return c;
}

std::vector<at::Tensor> values(const torch::nn::Sequential& seq) {
  std::vector<at::Tensor> out;
  for (const auto& item : seq->named_parameters()) out.push_back(item.value().detach().clone());
  return out;
}

void expect_same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "#" << i;
}

std::vector<Case> engine_cases() {
  using K = Kind;
  std::vector<Case> cases = {
      {"RoundPipe",
       "empty Sequential",
       K::kValue,
       {"RoundPipe", "no layers"},
       [] { RoundPipe m{torch::nn::Sequential()}; }},
      {"RoundPipe",
       "null Sequential holder",
       K::kValue,
       {"RoundPipe", "empty holder"},
       [] { RoundPipe m{torch::nn::Sequential(nullptr)}; }},
      {"RoundPipe",
       "a null layer",
       K::kValue,
       {"RoundPipe", "layer 0 of 2", "null"},
       [] {
         detail::EngineAccess::from_layers({nullptr, nullptr}, RoundPipeOptions());
       }},
      {"RoundPipe",
       "max_devices -1",
       K::kValue,
       {"RoundPipe", "max_devices", "got -1"},
       [] { RoundPipe m(make_mlp(), RoundPipeOptions().set_max_devices(-1)); }},
      {"RoundPipe",
       "max_devices beyond the pool",
       K::kValue,
       {"RoundPipe", "max_devices", "got 99"},
       [] { RoundPipe m(make_mlp(), RoundPipeOptions().set_max_devices(99)); }},
      {"RoundPipe",
       "integer optim_dtype",
       K::kType,
       {"RoundPipe", "optim_dtype", "Long"},
       [] { RoundPipe m(make_mlp(), RoundPipeOptions().set_optim_dtype(at::kLong)); }},
      {"RoundPipe",
       "run_config num_microbatch 0",
       K::kValue,
       {"RoundPipe", "num_microbatch must be >= 1, got 0"},
       [] {
         RoundPipe m(make_mlp(), RoundPipeOptions().set_run_config(RunConfig().num_microbatch(0)));
       }},
      {"RoundPipe",
       "run_config plan past the last layer",
       K::kValue,
       {"RoundPipe", "range(0, 50)"},
       [] {
         RoundPipe m(make_mlp(), RoundPipeOptions().set_run_config(RunConfig().execute_plan({{{0, 50}}, {}})));
       }},
      {"RoundPipe",
       "layer that is not cloneable",
       K::kValue,
       {"RoundPipe", "layer 0", "cannot be cloned"},
       [] { RoundPipe m{torch::nn::Sequential(std::make_shared<PlainModule>())}; }},
      {"RoundPipe",
       "parameters off the CPU (meta)",
       K::kValue,
       {"RoundPipe", "layer 0", "CPU"},
       [] { RoundPipe m{torch::nn::Sequential(MetaParam())}; }},
      {"RoundPipe::forward(Tensor)",
       "model returns a tuple",
       K::kType,
       {"forward(Tensor)", "forward(args, kwargs)"},
       [] {
         torch::manual_seed(3);
         RoundPipe m(torch::nn::Sequential(Embed(), Block()), RoundPipeOptions().set_max_devices(1));
         m.forward(torch::randint(kVocab, {2, kSeq}), RunConfig().num_microbatch(1).requires_grad(false));
       }},
      {"get_recompute_data",
       "outside recomputation",
       K::kError,
       {"get_recompute_data", "outside recomputation"},
       [] { get_recompute_data(); }},
  };
  {
    const int64_t before = get_sync_warmup_steps();
    cases.push_back({"set_sync_warmup_steps", "n -1", K::kValue, {"set_sync_warmup_steps", "got -1"},
                     [] { set_sync_warmup_steps(-1); },
                     [before] { EXPECT_EQ(get_sync_warmup_steps(), before); }});
  }
  return cases;
}

std::vector<Case> plan_cases() {
  using K = Kind;
  const ModelExecutePlan good{{{0, 2}, {2, 4}}, {{2, 4}, {0, 2}}};
  return {
      {"ModelExecutePlan::validate", "no layers", K::kValue, {"ModelExecutePlan::validate", "at least 1 layer"},
       [good] { good.validate(0, RunKind::kTrain); }},
      {"ModelExecutePlan::validate", "empty range", K::kValue, {"forward ranges", "non-empty", "range(2, 2)"},
       [] { ModelExecutePlan{{{0, 2}, {2, 2}, {2, 4}}, {{0, 4}}}.validate(4, RunKind::kTrain); }},
      {"ModelExecutePlan::validate", "negative begin", K::kValue, {"forward ranges", "range(-1, 4)"},
       [] { ModelExecutePlan{{{-1, 4}}, {{0, 4}}}.validate(4, RunKind::kTrain); }},
      {"ModelExecutePlan::validate", "gap in the forward plan", K::kValue, {"forward ranges", "contiguous"},
       [] { ModelExecutePlan{{{0, 1}, {2, 4}}, {{0, 4}}}.validate(4, RunKind::kTrain); }},
      {"default_plan", "no layers", K::kValue, {"default_plan", "at least 1 layer"},
       [] { default_plan({}, 1, RunKind::kTrain); }},
      {"default_plan", "0 devices", K::kValue, {"default_plan", "num_devices=0"},
       [] { default_plan({10, 10}, 0, RunKind::kTrain); }},
      {"default_plan", "negative layer bytes", K::kValue, {"default_plan", "layer 1", "-5"},
       [] { default_plan({10, -5}, 1, RunKind::kTrain); }},
      {"auto_plan", "no model", K::kValue, {"auto_plan", "model"},
       [] { auto_plan({}, AutoPlanOptions()); }},
      {"auto_plan", "a model without layers", K::kValue, {"LayerCosts", "no layer"},
       [] { auto_plan({LayerCosts()}, AutoPlanOptions()); }},
      {"auto_plan", "cost vectors of different lengths", K::kValue, {"LayerCosts", "3 fwd_ms", "2 bwd_ms"},
       [] {
         LayerCosts c = costs_of(3);
         c.bwd_ms.pop_back();
         auto_plan({c}, AutoPlanOptions());
       }},
      {"auto_plan", "negative cost", K::kValue, {"fwd_ms[1]", "-1"},
       [] {
         LayerCosts c = costs_of(3);
         c.fwd_ms[1] = -1;
         auto_plan({c}, AutoPlanOptions());
       }},
      {"auto_plan", "NaN cost", K::kValue, {"recompute_ms[2]", "nan"},
       [] {
         LayerCosts c = costs_of(3);
         c.recompute_ms[2] = std::nan("");
         auto_plan({c}, AutoPlanOptions());
       }},
      {"auto_plan", "min_stages 0", K::kValue, {"auto_plan", "min_stages", "got 0"},
       [] { auto_plan({costs_of(3)}, AutoPlanOptions().set_min_stages(0)); }},
      {"auto_plan", "negative memory limit", K::kValue, {"auto_plan", "model_memory_limit_bytes", "-1"},
       [] { auto_plan({costs_of(3)}, AutoPlanOptions().set_model_memory_limit_bytes(-1)); }},
      {"auto_plan", "a layer larger than the memory limit", K::kValue, {"auto_plan", "layer", "limit"},
       [] { auto_plan({costs_of(3)}, AutoPlanOptions().set_model_memory_limit_bytes(100)); }},
      {"choose_plan", "min_gain 1", K::kValue, {"choose_plan", "min_gain", "got 1"},
       [good] { choose_plan(good, good, costs_of(4), RunKind::kTrain, 1.0); }},
      {"choose_plan", "candidate for another layer count", K::kValue, {"forward ranges", "3 layers", "range(2, 4)"},
       [good] { choose_plan(ModelExecutePlan(), good, costs_of(3), RunKind::kTrain); }},
      {"choose_plan", "vectors of different lengths", K::kValue, {"choose_plan", "2 current plans, 1 candidate"},
       [good] { choose_plan({good, good}, {good}, {costs_of(4)}, RunKind::kTrain); }},
      {"worst_stage_ms", "plan for another layer count", K::kValue, {"forward ranges", "3 layers", "range(2, 4)"},
       [good] { worst_stage_ms(good, costs_of(3), RunKind::kTrain); }},
  };
}

std::vector<Case> microbatch_cases() {
  using K = Kind;
  const std::vector<c10::IValue> args{torch::randn({4, 3})};
  return {
      {"split_inputs", "n 0", K::kValue, {"split_inputs", "at least 1, got 0"},
       [args] { split_inputs(args, make_kwargs(), 0, InputSplit()); }},
      {"split_inputs", "tensor smaller than n", K::kValue, {"split_inputs", "cannot split", "[4, 3]"},
       [args] { split_inputs(args, make_kwargs(), 5, InputSplit()); }},
      {"split_inputs", "kwargs_spec names a missing key", K::kValue, {"split_inputs", "kwargs_spec", "'mask'"},
       [args] {
         InputSplit how;
         how.kwargs_spec = std::vector<std::pair<std::string, Spec>>{{"mask", Replicate()}};
         split_inputs(args, make_kwargs(), 2, how);
       }},
      {"split_inputs", "tuple spec for a tensor", K::kValue, {"split_inputs", "args[0]", "got a tensor of shape [4, 3]"},
       [args] {
         InputSplit how;
         how.args_spec = std::vector<Spec>{Spec::tuple({Spec()})};
         split_inputs(args, make_kwargs(), 2, how);
       }},
      {"split_inputs", "MicrobatchValues of the wrong count", K::kValue, {"split_inputs", "MicrobatchValues holds 3"},
       [] {
         split_inputs({make_microbatch_values({1, 2, 3})}, make_kwargs(), 2, InputSplit());
       }},
      {"split_label", "n -1", K::kValue, {"split_label", "got -1"},
       [] { split_label(torch::randn({4}), -1, LabelSplit()); }},
      {"Spec::dict", "duplicate key", K::kValue, {"Spec::dict", "duplicate key 'a'"},
       [] { Spec::dict({{"a", Spec()}, {"a", Replicate()}}); }},
      {"CustomReducer", "empty function", K::kValue, {"CustomReducer", "empty"},
       [] { CustomReducer(c10::IValue(0), Spec::ReduceFn()); }},
      {"merge_outputs", "no outputs", K::kValue, {"merge_outputs", "no microbatch outputs"},
       [] { merge_outputs({}, OutputMerge()); }},
      {"merge_outputs", "structures differ", K::kValue, {"merge_outputs", "microbatch 1"},
       [] {
         merge_outputs({c10::ivalue::Tuple::create({torch::ones({1})}), c10::IValue(torch::ones({1}))},
                       OutputMerge());
       }},
      {"merge_outputs", "scalars differ", K::kValue, {"merge_outputs", "microbatch 0 and microbatch 1"},
       [] { merge_outputs({c10::IValue(1), c10::IValue(2)}, OutputMerge()); }},
  };
}

std::vector<Case> optimizer_cases() {
  using K = Kind;
  auto param = [] { return torch::randn({3, 2}).requires_grad_(); };
  std::vector<Case> cases = {
      {"Adam", "lr -1", K::kValue, {"Adam", "learning rate", "-1"},
       [=] { optim::Adam({param()}, optim::AdamOptions(-1.0)); }},
      {"Adam", "beta1 1", K::kValue, {"Adam", "beta", "1"},
       [=] { optim::Adam({param()}, optim::AdamOptions(1e-3).betas({1.0, 0.999})); }},
      {"Adam", "eps -1", K::kValue, {"Adam", "epsilon", "-1"},
       [=] { optim::Adam({param()}, optim::AdamOptions(1e-3).eps(-1)); }},
      {"AdamW", "lr NaN", K::kValue, {"AdamW", "learning rate", "nan"},
       [=] { optim::AdamW({param()}, optim::AdamWOptions(std::nan(""))); }},
      {"Adam", "weight_decay -1", K::kValue, {"Adam", "weight_decay", "-1"},
       [=] { optim::Adam({param()}, optim::AdamOptions(1e-3).weight_decay(-1)); }},
      {"Adam", "float64 parameter", K::kType, {"Adam", "parameter 1", "float32", "Double"},
       [=] { optim::Adam({param(), torch::randn({2}, torch::kDouble).requires_grad_()}); }},
      {"Adam", "non-contiguous parameter", K::kValue, {"Adam", "parameter 0", "contiguous"},
       [] { optim::Adam({torch::randn({3, 4}).t().requires_grad_()}); }},
      {"Adam", "undefined parameter", K::kValue, {"Adam", "parameter 0", "undefined"},
       [] { optim::Adam({at::Tensor()}); }},
      {"SGD", "lr -1", K::kValue, {"SGD", "learning rate", "-1"}, [=] { optim::SGD({param()}, -1.0); }},
      {"SGD", "momentum -1", K::kValue, {"SGD", "momentum", "-1"},
       [=] { optim::SGD({param()}, optim::SGDOptions(0.1).momentum(-1)); }},
      {"SGD", "nesterov without momentum", K::kValue, {"SGD", "Nesterov"},
       [=] { optim::SGD({param()}, optim::SGDOptions(0.1).nesterov(true)); }},
      {"SGD", "weight_decay -1", K::kValue, {"SGD", "weight_decay", "-1"},
       [=] { optim::SGD({param()}, optim::SGDOptions(0.1).weight_decay(-1)); }},
      {"SGD", "parameter on the meta device", K::kType, {"SGD", "parameter 0", "CPU"},
       [] { optim::SGD({torch::zeros({2}, torch::Device(torch::kMeta)).requires_grad_()}, 0.1); }},
  };
  {
    // step() with a gradient of the wrong shape: checked before anything moves.
    auto p = std::make_shared<std::vector<at::Tensor>>(std::vector<at::Tensor>{param(), param()});
    auto opt = std::make_shared<optim::Adam>(*p, optim::AdamOptions(0.1));
    auto before = std::make_shared<std::vector<at::Tensor>>();
    cases.push_back({"Adam::step", "gradient of the wrong shape", K::kValue, {"Adam", "parameter 1", "gradient"},
                     [=] {
                       (*p)[0].mutable_grad() = torch::ones({3, 2});
                       (*p)[1].mutable_grad() = torch::ones({2, 3});
                       for (auto& t : *p) before->push_back(t.detach().clone());
                       opt->step();
                     },
                     [=] {
                       expect_same({(*p)[0].detach(), (*p)[1].detach()}, *before);
                       EXPECT_TRUE(opt->state().empty());
                       (*p)[1].mutable_grad() = torch::ones({3, 2});
                       opt->step();
                       EXPECT_FALSE(at::equal((*p)[1], (*before)[1]));
                     }});
  }
  {
    auto p = std::make_shared<at::Tensor>(param());
    auto opt = std::make_shared<optim::SGD>(std::vector<at::Tensor>{*p}, optim::SGDOptions(0.1));
    auto before = std::make_shared<at::Tensor>();
    cases.push_back({"SGD::step_with_lowp_copy", "float32 copy", K::kType, {"SGD", "low-precision copy"},
                     [=] {
                       p->mutable_grad() = torch::ones({3, 2});
                       *before = p->detach().clone();
                       opt->step_with_lowp_copy({torch::zeros({3, 2})});
                     },
                     [=] {
                       EXPECT_TRUE(at::equal(*p, *before));
                       at::Tensor copy = torch::zeros({3, 2}, torch::kBFloat16);
                       opt->step_with_lowp_copy({copy});
                       EXPECT_TRUE(at::equal(copy, p->detach().to(torch::kBFloat16)));
                     }});
    cases.push_back({"SGD::step_with_lowp_copy", "one copy too many", K::kValue, {"SGD", "2", "1"},
                     [=] { opt->step_with_lowp_copy({at::Tensor(), at::Tensor()}); }});
    cases.push_back({"SGD::step_with_lowp_copy", "copy of the wrong size", K::kValue, {"SGD", "5 elements"},
                     [=] { opt->step_with_lowp_copy({torch::zeros({5}, torch::kBFloat16)}); }});
  }
  return cases;
}

std::vector<Case> scaler_cases() {
  using K = Kind;
  std::vector<Case> cases = {
      {"GradScaler", "init_scale 0", K::kValue, {"GradScaler", "init_scale", "got 0"},
       [] { GradScaler s(GradScalerOptions().set_init_scale(0)); }},
      {"GradScaler", "init_scale inf", K::kValue, {"GradScaler", "init_scale", "inf"},
       [] { GradScaler s(GradScalerOptions().set_init_scale(std::numeric_limits<double>::infinity())); }},
      {"GradScaler", "growth_factor 0.5", K::kValue, {"GradScaler", "growth_factor", "0.5"},
       [] { GradScaler s(GradScalerOptions().set_growth_factor(0.5)); }},
      {"GradScaler", "backoff_factor 1.5", K::kValue, {"GradScaler", "backoff_factor", "1.5"},
       [] { GradScaler s(GradScalerOptions().set_backoff_factor(1.5)); }},
      {"GradScaler", "growth_interval 0", K::kValue, {"GradScaler", "growth_interval", "got 0"},
       [] { GradScaler s(GradScalerOptions().set_growth_interval(0)); }},
  };
  auto scaler = std::make_shared<GradScaler>(GradScalerOptions().set_init_scale(8));
  auto unchanged = [scaler] {
    EXPECT_EQ(scaler->get_scale(), 8.0);
    EXPECT_EQ(scaler->get_growth_factor(), 2.0);
    EXPECT_EQ(scaler->get_backoff_factor(), 0.5);
    EXPECT_EQ(scaler->get_growth_interval(), 2000);
    EXPECT_TRUE(at::equal(scaler->scale(torch::ones({2})), torch::full({2}, 8.0)));
  };
  cases.push_back({"GradScaler::set_growth_factor", "1", K::kValue, {"GradScaler", "growth_factor", "got 1"},
                   [scaler] { scaler->set_growth_factor(1.0); }, unchanged});
  cases.push_back({"GradScaler::set_backoff_factor", "0", K::kValue, {"GradScaler", "backoff_factor", "got 0"},
                   [scaler] { scaler->set_backoff_factor(0.0); }, unchanged});
  cases.push_back({"GradScaler::set_growth_interval", "-1", K::kValue, {"GradScaler", "growth_interval", "got -1"},
                   [scaler] { scaler->set_growth_interval(-1); }, unchanged});
  cases.push_back({"GradScaler::update", "new_scale NaN", K::kValue, {"GradScaler", "new_scale", "nan"},
                   [scaler] { scaler->update(std::nan("")); }, unchanged});
  cases.push_back({"GradScaler::update", "new_scale 0", K::kValue, {"GradScaler", "new_scale", "got 0"},
                   [scaler] { scaler->update(0.0); }, unchanged});
  cases.push_back({"GradScaler::update", "called off the main thread", K::kError, {"GradScaler", "update", "thread"},
                   [scaler] {
                     std::exception_ptr error;
                     std::thread t([&] {
                       try {
                         scaler->update();
                       } catch (...) {
                         error = std::current_exception();
                       }
                     });
                     t.join();
                     if (error) std::rethrow_exception(error);
                   },
                   unchanged});
  cases.push_back({"GradScaler::load_state_dict", "empty dict", K::kError, {"GradScaler.load_state_dict", "empty"},
                   [scaler] {
                     c10::Dict<std::string, c10::IValue> d = scaler->state_dict().copy();
                     d.clear();
                     scaler->load_state_dict(d);
                   }, unchanged});
  cases.push_back({"GradScaler::load_state_dict", "missing key", K::kValue,
                   {"GradScaler.load_state_dict", "missing key"},
                   [scaler] {
                     c10::Dict<std::string, c10::IValue> d = scaler->state_dict().copy();
                     (void)d.erase("growth_interval");
                     scaler->load_state_dict(d);
                   },
                   unchanged});
  cases.push_back({"GradScaler::load_state_dict", "string value", K::kType, {"GradScaler.load_state_dict", "'scale'"},
                   [scaler] {
                     c10::Dict<std::string, c10::IValue> d = scaler->state_dict().copy();
                     d.insert_or_assign("scale", c10::IValue("big"));
                     scaler->load_state_dict(d);
                   },
                   unchanged});
  cases.push_back({"GradScaler::load_state_dict", "negative scale", K::kValue, {"GradScaler", "scale", "-1"},
                   [scaler] {
                     c10::Dict<std::string, c10::IValue> d = scaler->state_dict().copy();
                     d.insert_or_assign("scale", c10::IValue(-1.0));
                     scaler->load_state_dict(d);
                   },
                   unchanged});
  {
    auto p = std::make_shared<at::Tensor>(torch::ones({2}).requires_grad_());
    auto opt = std::make_shared<optim::SGD>(std::vector<at::Tensor>{*p}, 0.1);
    cases.push_back({"GradScaler::unscale_", "float16 gradients", K::kValue, {"GradScaler", "FP16"},
                     [scaler, p, opt] {
                       p->mutable_grad() = torch::ones({2}, torch::kHalf);
                       scaler->unscale_(*opt);
                     },
                     [scaler, p, opt] {
                       EXPECT_TRUE(at::equal(p->grad(), torch::ones({2}, torch::kHalf)));
                       p->mutable_grad() = torch::full({2}, 8.0);
                       scaler->step(*opt);
                       EXPECT_TRUE(at::allclose(*p, torch::full({2}, 0.9)));
                       scaler->update();
                     }});
    cases.push_back({"GradScaler::step", "a closure while enabled", K::kError, {"GradScaler", "Closure"},
                     [scaler, opt] { scaler->step(*opt, [] { return torch::zeros({}); }); }});
  }
  return cases;
}

std::vector<Case> file_cases() {
  using K = Kind;
  std::vector<Case> cases = {
      {"SafetensorsFile", "missing file", K::kError, {"absent.safetensors"},
       [] { SafetensorsFile f(temp_path("absent.safetensors")); }},
      {"SafetensorsFile", "garbage file", K::kValue, {"garbage.safetensors"},
       [] {
         write_bytes(temp_path("garbage.safetensors"), std::string(64, 'x'));
         SafetensorsFile f(temp_path("garbage.safetensors"));
       }},
      {"SafetensorsFile::tensor", "unknown name", K::kValue, {"ok.safetensors", "'nope'"},
       [] {
         save_safetensors(temp_path("ok.safetensors"), {{"w", torch::ones({2})}});
         SafetensorsFile(temp_path("ok.safetensors")).tensor("nope");
       }},
      {"save_safetensors", "duplicate names", K::kValue, {"cannot write safetensors file", "dup.safetensors", "'w'"},
       [] { save_safetensors(temp_path("dup.safetensors"), {{"w", torch::ones({2})}, {"w", torch::ones({2})}}); }},
      {"save_safetensors", "the name __metadata__", K::kValue, {"cannot write safetensors file", "__metadata__"},
       [] { save_safetensors(temp_path("meta.safetensors"), {{"__metadata__", torch::ones({2})}}); }},
      {"save_safetensors", "undefined tensor", K::kValue, {"cannot write safetensors file", "'w'", "undefined"},
       [] { save_safetensors(temp_path("undef.safetensors"), {{"w", at::Tensor()}}); }},
      {"save_safetensors", "complex dtype", K::kValue, {"cannot write safetensors file", "'w'", "ComplexFloat"},
       [] { save_safetensors(temp_path("complex.safetensors"), {{"w", torch::ones({2}, torch::kComplexFloat)}}); }},
      {"save_safetensors", "sparse tensor", K::kValue, {"cannot write safetensors file", "'w'", "Sparse"},
       [] { save_safetensors(temp_path("sparse.safetensors"), {{"w", torch::ones({2}).to_sparse()}}); }},
      {"save_safetensors", "directory missing", K::kError, {"cannot create", "no/such/dir/w.safetensors"},
       [] { save_safetensors(temp_path("no/such/dir/w.safetensors"), {{"w", torch::ones({2})}}); }},
      {"save_safetensors_sharded", "max_shard_bytes 0", K::kValue, {"save_safetensors_sharded", "max_shard_bytes"},
       [] { save_safetensors_sharded(temp_path("shards"), {{"w", torch::ones({2})}}, 0); }},
      {"load_safetensors_index", "missing index", K::kError, {"absent.index.json"},
       [] { load_safetensors_index(temp_path("absent.index.json")); }},
      {"load_safetensors_index", "invalid JSON", K::kValue, {"bad.index.json"},
       [] {
         write_bytes(temp_path("bad.index.json"), "{\"weight_map\": ");
         load_safetensors_index(temp_path("bad.index.json"));
       }},
      {"load_safetensors_index", "shard outside the directory", K::kValue, {"up.index.json", ".."},
       [] {
         write_bytes(temp_path("up.index.json"), R"({"weight_map": {"w": "../x.safetensors"}})");
         load_safetensors_index(temp_path("up.index.json"));
       }},
      {"load_safetensors_checkpoint", "directory without weights", K::kValue,
       {"empty_dir", "neither"},
       [] {
         std::filesystem::create_directories(temp_path("empty_dir"));
         load_safetensors_checkpoint(temp_path("empty_dir"));
       }},
      {"start_trace", "empty path", K::kValue, {"start_trace", "path is empty"}, [] { start_trace(""); },
       [] { EXPECT_FALSE(tracing()); }},
      {"stop_trace", "directory missing", K::kError, {"no/such/dir"},
       [] {
         start_trace(temp_path("no/such/dir/trace.json"));
         stop_trace();
       },
       [] { EXPECT_FALSE(tracing()); }},
  };
  return cases;
}

std::vector<Case> model_file_cases() {
  using K = Kind;
  auto with = [](std::function<void(DecoderConfig&)> edit) {
    DecoderConfig c = tiny_config();
    edit(c);
    return c;
  };
  std::vector<Case> cases = {
      {"DecoderConfig::validate", "hidden_size 0", K::kValue, {"hidden_size", "0"},
       [=] { with([](DecoderConfig& c) { c.hidden_size = 0; }).validate(); }},
      {"DecoderConfig::validate", "model_type gpt2", K::kValue, {"model_type", "gpt2"},
       [=] { with([](DecoderConfig& c) { c.model_type = "gpt2"; }).validate(); }},
      {"DecoderConfig::validate", "heads not a multiple of kv heads", K::kValue, {"num_key_value_heads"},
       [=] { with([](DecoderConfig& c) { c.num_attention_heads = 3; c.num_key_value_heads = 2; c.head_dim = 8; }).validate(); }},
      {"DecoderConfig::validate", "odd head dimension", K::kValue, {"head"},
       [=] { with([](DecoderConfig& c) { c.head_dim = 7; }).validate(); }},
      {"DecoderConfig::validate", "unknown rope type", K::kValue, {"rope", "yarn"},
       [=] { with([](DecoderConfig& c) { c.rope_scaling.rope_type = "yarn"; }).validate(); }},
      {"make_decoder", "negative layer count", K::kValue, {"num_hidden_layers", "-1"},
       [=] { make_decoder(with([](DecoderConfig& c) { c.num_hidden_layers = -1; })); }},
      {"from_hf_config_json", "invalid JSON", K::kValue, {"JSON"}, [] { from_hf_config_json("{\"model_type\": "); }},
      {"from_hf_config_json", "missing field", K::kValue, {"vocab_size"},
       [] {
         from_hf_config_json(R"({"model_type": "llama", "hidden_size": 8, "intermediate_size": 8,
                                "num_hidden_layers": 1, "num_attention_heads": 1})");
       }},
      {"from_hf_config_json", "mistyped field", K::kValue, {"hidden_size"},
       [] {
         from_hf_config_json(R"({"model_type": "llama", "vocab_size": 8, "hidden_size": "8",
                                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1})");
       }},
      {"from_hf_config_json", "hidden_act gelu", K::kValue, {"hidden_act", "gelu"},
       [] {
         from_hf_config_json(R"({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                                "num_hidden_layers": 1, "num_attention_heads": 1, "hidden_act": "gelu"})");
       }},
      {"load_hf_config", "missing file", K::kValue, {"absent_config.json"},
       [] { load_hf_config(temp_path("absent_config.json")); }},
      {"chunked_cross_entropy", "chunk_size 0", K::kValue, {"chunked_cross_entropy", "chunk_size"},
       [] { chunked_cross_entropy(torch::randn({4, 8}), torch::randn({10, 8}), torch::zeros({4}, torch::kLong), 0); }},
      {"chunked_cross_entropy", "label out of range", K::kValue, {"chunked_cross_entropy", "label", "10"},
       [] { chunked_cross_entropy(torch::randn({4, 8}), torch::randn({10, 8}), torch::full({4}, 10, torch::kLong)); }},
      {"chunked_cross_entropy", "hidden width differs from weight", K::kValue, {"chunked_cross_entropy", "[4, 7]"},
       [] { chunked_cross_entropy(torch::randn({4, 7}), torch::randn({10, 8}), torch::zeros({4}, torch::kLong)); }},
      {"preset_loss_fn", "non-scalar outputs", K::kValue, {"preset_loss_fn"},
       [] { preset_loss_fn()(c10::IValue(torch::randn({2, 3})), c10::IValue()); }},
      {"Projection::add_adapter", "rank 0", K::kValue, {"add_adapter", "rank"},
       [] { Projection(4, 4, false)->add_adapter(0, 1.0); }},
      {"LoraConfig::validate", "rank 0", K::kValue, {"LoraConfig", "rank", "got 0"},
       [] {
         LoraConfig c;
         c.rank = 0;
         c.validate();
       }},
      {"LoraConfig::validate", "alpha NaN", K::kValue, {"LoraConfig", "alpha", "nan"},
       [] {
         LoraConfig c;
         c.alpha = std::nan("");
         c.validate();
       }},
      {"LoraConfig::validate", "empty target_modules", K::kValue, {"LoraConfig", "target_modules"},
       [] {
         LoraConfig c;
         c.target_modules.clear();
         c.validate();
       }},
      {"LoraConfig::validate", "unknown target", K::kValue, {"LoraConfig", "'attn'"},
       [] {
         LoraConfig c;
         c.target_modules = {"attn"};
         c.validate();
       }},
      {"apply_lora", "not a preset", K::kValue, {"apply_lora", "make_decoder"},
       [] {
         torch::nn::Sequential net = make_mlp();
         apply_lora(net, LoraConfig());
       }},
      {"apply_lora", "null Sequential holder", K::kValue, {"apply_lora", "null"},
       [] {
         torch::nn::Sequential net(nullptr);
         apply_lora(net, LoraConfig());
       }},
      {"LoraConfig::validate", "unknown frozen_weights", K::kValue, {"LoraConfig", "frozen_weights", "'nf3'"},
       [] {
         LoraConfig c;
         c.frozen_weights = "nf3";
         c.validate();
       }},
      {"Projection::pack_weight", "trained weight", K::kValue, {"pack_weight", "requires_grad"},
       [] { Projection(4, 4, false)->pack_weight("nf4"); }},
      {"Projection::pack_weight", "unknown format", K::kValue, {"pack_weight", "'q8'", "nf4, fp4, int8"},
       [] { Projection(4, 4, false)->pack_weight("q8"); }},
      {"pack_frozen_weights", "not a preset", K::kValue, {"pack_frozen_weights", "make_decoder"},
       [] {
         torch::nn::Sequential net = make_mlp();
         pack_frozen_weights(net, "nf4");
       }},
      {"pack_frozen_weights", "null Sequential holder", K::kValue, {"pack_frozen_weights", "null"},
       [] {
         torch::nn::Sequential net(nullptr);
         pack_frozen_weights(net, "int8");
       }},
      {"quantize_weight", "not 2-d", K::kValue, {"quantize_weight", "[out, in]"},
       [] { quantize_weight(torch::ones({4}), "fp4"); }},
  };
  {
    torch::manual_seed(5);
    auto net = std::make_shared<torch::nn::Sequential>(make_decoder(tiny_config()));
    apply_lora(*net, LoraConfig());
    auto before = std::make_shared<std::vector<at::Tensor>>(values(*net));
    cases.push_back({"apply_lora", "called twice", K::kValue, {"apply_lora", "already"},
                     [net] { apply_lora(*net, LoraConfig()); },
                     [net, before] {
                       expect_same(values(*net), *before);
                       EXPECT_EQ(lora_parameters(*net).size(), 8u);  // A and B of q, k, v, o
                     }});
  }
  return cases;
}

std::vector<Case> data_cases() {
  using K = Kind;
  std::vector<Case> cases = {
      {"parse_token_dtype", "int8", K::kValue, {"int8", "uint16"}, [] { parse_token_dtype("int8"); }},
      {"TokenFile", "missing file", K::kError, {"absent.bin"}, [] { TokenFile f(temp_path("absent.bin")); }},
      {"TokenFile", "empty file", K::kValue, {"empty.bin", "empty"},
       [] {
         write_bytes(temp_path("empty.bin"), "");
         TokenFile f(temp_path("empty.bin"));
       }},
      {"TokenFile", "size not a multiple of the dtype", K::kValue, {"odd.bin", "multiple"},
       [] {
         write_bytes(temp_path("odd.bin"), "abc");
         TokenFile f(temp_path("odd.bin"));
       }},
      {"TokenFile", "negative vocab_size", K::kValue, {"vocab_size", "-3"},
       [] {
         write_bytes(temp_path("ok.bin"), "abcd");
         TokenFile f(temp_path("ok.bin"), TokenFileOptions().set_vocab_size(-3));
       }},
      {"TokenFile::from_tensor", "2-D tensor", K::kValue, {"token data '<memory>'", "1-D"},
       [] { TokenFile::from_tensor(torch::zeros({2, 2}, torch::kLong)); }},
      {"TokenFile::from_tensor", "float tensor", K::kValue, {"token data '<memory>'", "integer", "Float"},
       [] { TokenFile::from_tensor(torch::zeros({4})); }},
      {"TokenFile::from_tensor", "negative token", K::kValue, {"token data '<memory>'", "-1"},
       [] { TokenFile::from_tensor(torch::tensor({1, -1}, torch::kLong)); }},
      {"TokenFile::from_tensor", "token >= vocab_size", K::kValue, {"vocab_size", "9"},
       [] { TokenFile::from_tensor(torch::tensor({1, 9}, torch::kLong), "mem", TokenFileOptions().set_vocab_size(9)); }},
      {"write_token_file", "token too large for uint16", K::kValue, {"cannot write token file", "70000"},
       [] { write_token_file(temp_path("big.bin"), torch::tensor({1, 70000}, torch::kLong), TokenDtype::kUInt16); },
       [] { EXPECT_FALSE(std::filesystem::exists(temp_path("big.bin"))); }},
      {"write_token_file", "float tensor", K::kValue, {"cannot write token file", "Float"},
       [] { write_token_file(temp_path("float.bin"), torch::zeros({4}), TokenDtype::kUInt16); }},
      {"shuffled_order", "n -1", K::kValue, {"shuffled_order", "-1"}, [] { shuffled_order(-1, 0, 0); }},
      {"decode_bytes", "token 300", K::kValue, {"decode_bytes", "300"},
       [] { decode_bytes(torch::tensor({65, 300}, torch::kLong)); }},
      {"decode_bytes", "float tensor", K::kValue, {"decode_bytes", "Float"},
       [] { decode_bytes(torch::ones({2})); }},
      {"TokenBatcher", "seq_len 0", K::kValue, {"seq_len must be >= 1, got 0"},
       [] { TokenBatcher b(TokenFile::from_tensor(at::arange(100)), TokenBatcherOptions(0)); }},
      {"TokenBatcher", "eval_fraction 1.5", K::kValue, {"eval_fraction"},
       [] { TokenBatcher b(TokenFile::from_tensor(at::arange(100)), TokenBatcherOptions(4).eval_fraction(1.5)); }},
      {"TokenBatcher", "too little data", K::kValue, {"'small'", "too few"},
       [] { TokenBatcher b(TokenFile::from_tensor(at::arange(5), "small"), TokenBatcherOptions(8)); }},
  };
  {
    auto file = std::make_shared<TokenFile>(TokenFile::from_tensor(at::arange(100), "hundred"));
    cases.push_back({"TokenFile::tokens", "range past the end", K::kValue, {"hundred", "98"},
                     [file] { file->tokens(98, 5); },
                     [file] { EXPECT_TRUE(at::equal(file->tokens(98, 2), at::arange(98, 100))); }});
    cases.push_back({"TokenFile::tokens", "negative count", K::kValue, {"hundred", "-1"},
                     [file] { file->tokens(0, -1); }});
    auto batcher = std::make_shared<TokenBatcher>(*file, TokenBatcherOptions(4).seed(3));
    batcher->next_batch(2);
    const DataPosition pos = batcher->position();
    auto unchanged = [batcher, pos] {
      EXPECT_EQ(batcher->position(), pos);
      TokenBatcher fresh(TokenFile::from_tensor(at::arange(100), "hundred"), TokenBatcherOptions(4).seed(3));
      fresh.seek(pos);
      EXPECT_TRUE(at::equal(batcher->next_batch(3).input_ids, fresh.next_batch(3).input_ids));
      batcher->seek(pos);
    };
    cases.push_back({"TokenBatcher::next_batch", "batch_size 0", K::kValue, {"next_batch", "batch_size", "got 0"},
                     [batcher] { batcher->next_batch(0); }, unchanged});
    cases.push_back({"TokenBatcher::seek", "index past the end", K::kValue, {"seek", "index", "99"},
                     [batcher] { batcher->seek({3, 0, 99}); }, unchanged});
    cases.push_back({"TokenBatcher::seek", "negative epoch", K::kValue, {"seek", "epoch", "-1"},
                     [batcher] { batcher->seek({3, -1, 0}); }, unchanged});
    cases.push_back({"TokenBatcher::eval_batches", "batch_size 0", K::kValue, {"eval_batches", "batch_size"},
                     [batcher] { batcher->eval_batches(0); }, unchanged});
    cases.push_back({"TokenBatcher::train_window_offset", "window -1", K::kValue, {"TokenBatcher", "training window -1"},
                     [batcher] { batcher->train_window_offset(-1); }, unchanged});
    cases.push_back({"TokenBatcher::eval_window_offset", "no evaluation windows", K::kValue,
                     {"TokenBatcher", "evaluation window 0"}, [batcher] { batcher->eval_window_offset(0); }, unchanged});
    cases.push_back({"TokenBatcher::window_at", "index past the end", K::kValue, {"TokenBatcher", "index 1000"},
                     [batcher] { batcher->window_at(0, 0, 1000); }, unchanged});
  }
  {
    auto timer = std::make_shared<ModelTimer>(2);
    timer->record(0, LayerAction::kForward, 1.0);
    timer->record(0, LayerAction::kForward, 2.0);
    const auto state = timer->state();
    auto unchanged = [timer, state] {
      const auto now = timer->state();
      ASSERT_EQ(now.size(), state.size());
      for (size_t i = 0; i < now.size(); ++i) {
        EXPECT_EQ(now[i].count, state[i].count);
        EXPECT_EQ(now[i].biased_mean, state[i].biased_mean);
      }
      EXPECT_EQ(timer->estimate(0, LayerAction::kForward), c10::optional<double>(2.0));
    };
    cases.push_back({"ModelTimer", "num_layers -1", K::kValue, {"ModelTimer", "got -1"}, [] { ModelTimer t(-1); }});
    cases.push_back({"ModelTimer::record", "layer out of range", K::kValue, {"ModelTimer", "layer 2"},
                     [timer] { timer->record(2, LayerAction::kForward, 1.0); }, unchanged});
    cases.push_back({"ModelTimer::record", "negative time", K::kValue, {"ModelTimer", "got -1"},
                     [timer] { timer->record(0, LayerAction::kForward, -1.0); }, unchanged});
    cases.push_back({"ModelTimer::record", "NaN time", K::kValue, {"ModelTimer", "nan"},
                     [timer] { timer->record(1, LayerAction::kBackward, std::nan("")); }, unchanged});
    cases.push_back({"ModelTimer::estimate", "layer -1", K::kValue, {"ModelTimer", "layer -1"},
                     [timer] { timer->estimate(-1, LayerAction::kForward); }, unchanged});
    cases.push_back({"ModelTimer::load_state", "state of another size", K::kValue, {"ModelTimer::load_state"},
                     [timer] { timer->load_state(std::vector<ModelTimer::Entry>(3)); }, unchanged});
  }
  return cases;
}

void run_cases(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    SCOPED_TRACE(c.entry + "(" + c.bad + ")");
    EXPECT_EQ(check_throws(c.call, c.kind, c.fragments), "");
    if (c.after) c.after();
  }
}

TEST(BadInputCatalog, EngineEntryPoints) { run_cases(engine_cases()); }
TEST(BadInputCatalog, Plans) { run_cases(plan_cases()); }
TEST(BadInputCatalog, MicrobatchSpecs) { run_cases(microbatch_cases()); }
TEST(BadInputCatalog, Optimizers) { run_cases(optimizer_cases()); }
TEST(BadInputCatalog, GradScaler) { run_cases(scaler_cases()); }
TEST(BadInputCatalog, FilesAndTraces) { run_cases(file_cases()); }
TEST(BadInputCatalog, PresetsAndLora) { run_cases(model_file_cases()); }
TEST(BadInputCatalog, TokenDataAndTimer) { run_cases(data_cases()); }

}  // namespace
}  // namespace testing
}  // namespace roundpipe
