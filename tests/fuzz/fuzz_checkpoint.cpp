// Fuzz target: the checkpoint loader (include/roundpipe/checkpoint.h,
// load_checkpoint) on bad files, for a tiny fixed model with an Adam
// optimizer and a GradScaler. The first input byte picks what the rest is:
//   even: the whole file, as is: the frame, length and hash checks see it;
//   odd:  edits to the entries of a valid checkpoint (entries dropped, of
//         another type, ints, names, shapes and dtypes changed), written as a
//         libtorch archive and framed with a correct hash, so that the entry
//         checks behind the frame see them.
// (Byte edits inside a correctly hashed archive are not tried: libtorch's
// archive reader does not withstand crafted bytes, see checkpoint.h.)
// Each load must succeed or throw c10::Error, and a failed load must leave
// the model's parameters and optimizer copies, the optimizer's and the
// scaler's state and the CheckpointState as they were.
// With ROUNDPIPE_FUZZ_WRITE_SEEDS=<dir> it writes a valid checkpoint there
// (valid-file): the file-* inputs of the corpus are made from it.
#include <roundpipe/checkpoint.h>
#include <roundpipe/grad_scaler.h>
#include <roundpipe/roundpipe.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <torch/torch.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "engine/checkpoint_file.h"

namespace {

using c10::IValue;
using roundpipe::CheckpointState;
using roundpipe::GradScaler;
using roundpipe::RoundPipe;

RoundPipe MakeModel() {
  torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::Tanh(), torch::nn::Linear(4, 2));
  return RoundPipe(net, roundpipe::RoundPipeOptions().set_max_devices(1).set_seed(7));
}

using Entries = std::vector<std::pair<std::string, IValue>>;

struct Fixture {
  RoundPipe model = MakeModel();
  torch::optim::Adam opt{model.optim_parameters(), torch::optim::AdamOptions(1e-2)};
  GradScaler scaler;
  std::string dir;
  Entries entries;  // of a valid checkpoint saved with the scaler (not the optimizer: see Archive)
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void PutLe64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i, v >>= 8) s.push_back(static_cast<char>(v & 0xff));
}

// The checkpoint file frame (checkpoint_file.h) around `archive`.
std::string Framed(const std::string& archive) {
  roundpipe::detail::Hash64 hash;
  hash.update(archive.data(), archive.size());
  std::string out = "RPCKPT01" + archive;
  PutLe64(out, archive.size());
  PutLe64(out, hash.digest());
  return out + "RPCKEND1";
}

Fixture& Get() {
  static Fixture* f = [] {
    auto* fx = new Fixture;
    const char* shm = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    fx->dir = std::string(shm) + "/roundpipe_fuzz_ckpt_" + std::to_string(getpid());
    ::mkdir(fx->dir.c_str(), 0700);
    // One step of training, so that the file holds optimizer state, and a
    // pending gradient.
    torch::manual_seed(3);
    auto loss = [](const IValue& out, const IValue& y) -> IValue {
      return torch::mse_loss(out.toTensor(), y.toTensor());
    };
    fx->model.forward_backward({torch::randn({4, 4})}, roundpipe::make_kwargs(),
                               torch::randn({4, 2}), loss);
    fx->model.step([fx] { fx->opt.step(); }, /*is_async=*/false);
    fx->model.forward_backward({torch::randn({4, 4})}, roundpipe::make_kwargs(),
                               torch::randn({4, 2}), loss);
    CheckpointState state;
    state.step = 5;
    state.metadata_json = "{\"fuzz\": 1}";
    state.scaler = &fx->scaler;
    const std::string path = fx->dir + "/valid.ckpt";
    roundpipe::save_checkpoint(path, fx->model, state);
    torch::serialize::InputArchive ar;
    roundpipe::detail::read_checkpoint_file(path, ar);
    for (const std::string& key : ar.keys()) {
      IValue v;
      if (ar.try_read(key, v)) fx->entries.emplace_back(key, v);
    }
    if (const char* seeds = std::getenv("ROUNDPIPE_FUZZ_WRITE_SEEDS")) {
      state.optimizer = &fx->opt;
      roundpipe::save_checkpoint(std::string(seeds) + "/valid-file", fx->model, state);
    }
    return fx;
  }();
  return *f;
}

// A value of some other kind, or a changed copy of `v`.
IValue Mutated(FuzzedDataProvider& in, const IValue& v) {
  switch (in.ConsumeIntegralInRange<int>(0, 9)) {
    case 0: return IValue(in.ConsumeIntegral<int64_t>());
    case 1: return IValue(in.ConsumeRandomLengthString(12));
    case 2: return IValue(c10::List<int64_t>());
    case 3: return IValue(c10::List<at::Tensor>({at::zeros({in.ConsumeIntegralInRange<int64_t>(0, 5)})}));
    case 4: return IValue(in.ConsumeFloatingPoint<double>());
    default: break;
  }
  if (v.isIntList()) {
    auto xs = v.toIntVector();
    if (!xs.empty() && in.ConsumeBool()) {
      xs[in.ConsumeIntegralInRange<size_t>(0, xs.size() - 1)] =
          in.ConsumeBool() ? in.ConsumeIntegral<int64_t>() : in.ConsumeIntegralInRange<int64_t>(-2, 4);
    } else if (!xs.empty() && in.ConsumeBool()) {
      xs.pop_back();
    } else {
      xs.push_back(in.ConsumeIntegral<int64_t>());
    }
    return IValue(c10::List<int64_t>(xs));
  }
  if (v.isDoubleList()) {
    auto xs = v.toDoubleVector();
    if (xs.empty()) xs.push_back(0);
    xs[in.ConsumeIntegralInRange<size_t>(0, xs.size() - 1)] = in.ConsumeFloatingPoint<double>();
    return IValue(c10::List<double>(xs));
  }
  if (v.isBoolList()) {
    auto xs = v.toBoolList().copy();
    xs.push_back(in.ConsumeBool());
    return IValue(xs);
  }
  if (v.isTensorList()) {
    auto xs = v.toTensorVector();
    if (xs.empty() || in.ConsumeBool()) {
      xs.push_back(at::zeros({2}));
    } else {
      at::Tensor& t = xs[in.ConsumeIntegralInRange<size_t>(0, xs.size() - 1)];
      switch (in.ConsumeIntegralInRange<int>(0, 3)) {
        case 0: t = t.to(at::kDouble); break;
        case 1: t = t.flatten(); break;
        case 2: t = t.unsqueeze(0); break;
        default: t = at::full_like(t, in.ConsumeFloatingPoint<float>()); break;  // any float value
      }
    }
    if (in.ConsumeBool()) xs.pop_back();
    return IValue(c10::List<at::Tensor>(xs));
  }
  if (v.isList()) {  // names
    auto xs = v.toListRef().vec();
    if (!xs.empty()) xs[in.ConsumeIntegralInRange<size_t>(0, xs.size() - 1)] = IValue(in.ConsumeRandomLengthString(8));
    if (in.ConsumeBool() && xs.size() > 1) std::swap(xs.front(), xs.back());
    c10::List<std::string> out;
    for (const auto& x : xs) out.push_back(x.isString() ? x.toStringRef() : std::string());
    return IValue(out);
  }
  if (v.isGenericDict()) {  // the scaler's state
    auto d = v.toGenericDict().copy();
    d.insert_or_assign(IValue(in.ConsumeRandomLengthString(8)),
                       d.valueType()->kind() == c10::TypeKind::FloatType ? IValue(in.ConsumeFloatingPoint<double>())
                                                                          : IValue(in.ConsumeIntegral<int64_t>()));
    return IValue(d);
  }
  if (v.isTensor()) return IValue(v.toTensor().to(at::kFloat));
  return IValue();
}

// A valid checkpoint's entries with a few of them dropped, replaced or
// changed, and the optimizer's state saved or not, as a libtorch archive.
// Empty when libtorch cannot write what came out.
std::string Archive(FuzzedDataProvider& in, Fixture& f) {
  Entries entries = f.entries;
  for (int edits = in.ConsumeIntegralInRange<int>(0, 3); edits > 0; --edits) {
    const size_t i = in.ConsumeIntegralInRange<size_t>(0, entries.size());
    if (i == entries.size()) {
      entries.emplace_back("extra", IValue(at::zeros({in.ConsumeIntegralInRange<int64_t>(0, 4)}, at::kByte)));
    } else if (in.ConsumeIntegralInRange<int>(0, 4) == 0) {
      entries.erase(entries.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      entries[i].second = Mutated(in, entries[i].second);
    }
  }
  try {
    torch::serialize::OutputArchive ar;
    for (const auto& [key, value] : entries) ar.write(key, value);
    if (in.ConsumeBool()) {
      torch::serialize::OutputArchive opt;
      f.opt.save(opt);  // its current state: the one that fits the model
      ar.write("optimizer", opt);
    }
    std::ostringstream os;
    ar.save_to(os);
    return os.str();
  } catch (const c10::Error&) {
    return "";
  }
}

std::string OptimizerBytes(torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive ar;
  opt.save(ar);
  std::ostringstream os;
  ar.save_to(os);
  return os.str();
}

// Everything a failed load must leave alone.
struct Snapshot {
  std::vector<at::Tensor> tensors;
  std::string optimizer;
  c10::Dict<std::string, IValue> scaler;
  int64_t step;
  std::string metadata;

  Snapshot(Fixture& f, const CheckpointState& s)
      : optimizer(OptimizerBytes(f.opt)), scaler(f.scaler.state_dict().copy()), step(s.step),
        metadata(s.metadata_json) {
    for (const auto& [name, t] : f.model.state_dict()) tensors.push_back(t.detach().clone());
    for (const auto& [name, t] : f.model.optim_named_parameters()) tensors.push_back(t.detach().clone());
  }

  // What differs from `o`, or "" when nothing does.
  std::string Diff(const Snapshot& o) const {
    if (tensors.size() != o.tensors.size()) return "the number of tensors";
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!tensors[i].equal(o.tensors[i])) return "parameter or optimizer copy #" + std::to_string(i);
    }
    if (scaler.size() != o.scaler.size()) return "the scaler's state";
    for (const auto& e : scaler) {
      if (!o.scaler.contains(e.key()) || o.scaler.at(e.key()) != e.value()) return "the scaler's " + e.key();
    }
    if (optimizer != o.optimizer) return "the optimizer's state";
    if (step != o.step || metadata != o.metadata) return "the CheckpointState";
    return "";
  }
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Get();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  Fixture& f = Get();
  const uint8_t mode = data[0];
  const uint8_t flags = data[1];  // what the load asks for
  std::string file;
  if (mode % 2 == 0) {
    file.assign(reinterpret_cast<const char*>(data) + 2, size - 2);
  } else {
    FuzzedDataProvider in(data + 2, size - 2);
    const std::string archive = Archive(in, f);
    if (archive.empty()) return 0;
    file = Framed(archive);
  }
  const std::string path = f.dir + "/input.ckpt";
  WriteFile(path, file);

  CheckpointState state;
  state.step = -3;
  state.metadata_json = "before";
  if (flags & 1) state.optimizer = &f.opt;
  if (flags & 2) state.scaler = &f.scaler;
  const Snapshot before(f, state);
  try {
    roundpipe::load_checkpoint(path, f.model, state);
  } catch (const c10::Error&) {
    const std::string changed = Snapshot(f, state).Diff(before);
    if (!changed.empty()) {
      std::fprintf(stderr, "a failed load changed %s\n", changed.c_str());
      std::abort();
    }
  }
  return 0;
}
