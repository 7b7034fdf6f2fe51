// Checkpoints of the whole training state (checkpoint.h): one libtorch
// archive in the frame of checkpoint_file.h, streamed to a temporary file and
// renamed over the target.
//
// Entries (all top-level attributes of the archive):
//   format "roundpipe-checkpoint", version 2 (version 1 is read too: its
//   `user` also held a data position, read as extra_state "data.*")
//   state_names [str], state [Tensor]        master parameters and buffers (state_dict order)
//   optim_names [str], optim [Tensor]        optimizer copies
//   accum_names/accum, grad_names/grad,      pending gradients: fp32 accumulators,
//   optim_grad_names/optim_grad              the masters' .grad, the copies' .grad
//   engine [int]                             num_layers, seed, next_call_id, steps_issued, behind
//   timer_warmed [bool], timer_count [int], timer_mean [float]
//   user [int]                               step
//   extra_state {str: int}                   CheckpointState::extra_state
//   metadata_json str
//   optimizer (nested archive), scaler_float {str: float}, scaler_int {str: int}   when given
//   extra Tensor (uint8)                     bindings' own bytes, when given
#include "engine/checkpoint_internal.h"
#include "engine/engine_access.h"
#include "engine/model_impl.h"

#include "engine/checkpoint_file.h"
#include "util/file_error.h"
#include "util/interrupt.h"

#include <ATen/ATen.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace roundpipe {
namespace detail {
namespace {

constexpr const char* kFormat = "roundpipe-checkpoint";
constexpr int64_t kVersion = 2;

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

// The tensor as it should be stored: its own compact storage (a view of a
// larger storage would save all of it), without autograd state.
at::Tensor storable(const at::Tensor& t) {
  at::Tensor d = t.detach();
  const bool compact = d.is_contiguous() && d.storage_offset() == 0 &&
                       d.storage().nbytes() == static_cast<size_t>(d.numel()) * d.element_size();
  return compact ? d : d.clone(at::MemoryFormat::Contiguous);
}

void write_named(torch::serialize::OutputArchive& ar, const std::string& key,
                 const std::vector<std::pair<std::string, at::Tensor>>& entries) {
  c10::List<std::string> names;
  c10::List<at::Tensor> values;
  for (const auto& [name, t] : entries) {
    names.push_back(name);
    values.push_back(storable(t));
  }
  ar.write(key + "_names", names);
  ar.write(key, values);
}

// ---- reading ----

// Errors of one load, all naming the file.
struct Reader {
  const std::string& path;
  torch::serialize::InputArchive& ar;

  [[noreturn]] void damaged(const std::string& what) const {
    TORCH_CHECK_VALUE(false, "load_checkpoint: '", path, "' is not a valid roundpipe checkpoint (", what,
                      "); it may be truncated or corrupt: load an earlier checkpoint");
  }

  c10::IValue get(const std::string& key) const {
    c10::IValue v;
    bool found = false;
    try {
      found = ar.try_read(key, v);
    } catch (const std::exception& e) {
      damaged("entry '" + key + "' cannot be read: " + message_of(e));
    }
    if (!found) damaged("entry '" + key + "' is missing");
    return v;
  }

  std::vector<int64_t> ints(const std::string& key) const {
    c10::IValue v = get(key);
    if (!v.isIntList()) damaged("entry '" + key + "' is not a list of ints");
    return v.toIntVector();
  }

  std::vector<std::string> strings(const std::string& key) const {
    c10::IValue v = get(key);
    if (!v.isList()) damaged("entry '" + key + "' is not a list");
    std::vector<std::string> out;
    for (const c10::IValue& e : v.toListRef()) {
      if (!e.isString()) damaged("entry '" + key + "' holds a non-string");
      out.push_back(e.toStringRef());
    }
    return out;
  }

  std::vector<at::Tensor> tensors(const std::string& key) const {
    c10::IValue v = get(key);
    if (!v.isTensorList()) damaged("entry '" + key + "' is not a list of tensors");
    std::vector<at::Tensor> out = v.toTensorVector();
    for (const at::Tensor& t : out) {
      if (!t.defined() || !t.device().is_cpu()) damaged("entry '" + key + "' holds an undefined or non-CPU tensor");
    }
    return out;
  }

  // name -> tensor of a write_named() pair of entries.
  std::vector<std::pair<std::string, at::Tensor>> named(const std::string& key) const {
    std::vector<std::string> names = strings(key + "_names");
    std::vector<at::Tensor> values = tensors(key);
    if (names.size() != values.size()) damaged("entries '" + key + "' and '" + key + "_names' differ in length");
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (size_t i = 0; i < names.size(); ++i) out.emplace_back(names[i], values[i]);
    return out;
  }
};

std::string first_of(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 3; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > 3) out += ", ...";
  return out;
}

// Pairs each wanted tensor with its saved value by name; checks that the
// names match exactly and shapes and dtypes agree.
std::vector<std::pair<at::Tensor, at::Tensor>> match(const std::string& path, const std::string& what,
                                                     const std::vector<std::pair<std::string, at::Tensor>>& wanted,
                                                     const std::vector<std::pair<std::string, at::Tensor>>& saved) {
  std::unordered_map<std::string, at::Tensor> by_name;
  for (const auto& [name, t] : saved) by_name[name] = t;
  std::vector<std::string> missing;
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  for (const auto& [name, dst] : wanted) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      missing.push_back(name);
      continue;
    }
    const at::Tensor& src = it->second;
    TORCH_CHECK_VALUE(src.sizes() == dst.sizes(), "load_checkpoint: '", path, "': ", what, " '", name,
                      "' has shape ", src.sizes(), " in the checkpoint but ", dst.sizes(),
                      " in the model (another architecture?)");
    TORCH_CHECK_VALUE(src.scalar_type() == dst.scalar_type(), "load_checkpoint: '", path, "': ", what, " '", name,
                      "' has dtype ", src.scalar_type(), " in the checkpoint but ", dst.scalar_type(),
                      " in the model (build the model with the same dtype and optim_dtype as the saved one)");
    out.emplace_back(dst, src);
    by_name.erase(it);
  }
  TORCH_CHECK_VALUE(missing.empty(), "load_checkpoint: '", path, "': ", missing.size(), " ", what,
                    " of the model missing from the checkpoint: ", first_of(missing),
                    " (it was saved from another architecture)");
  std::vector<std::string> unexpected;
  for (const auto& [name, t] : saved) {
    if (by_name.count(name)) unexpected.push_back(name);
  }
  TORCH_CHECK_VALUE(unexpected.empty(), "load_checkpoint: '", path, "': ", unexpected.size(), " ", what,
                    " in the checkpoint that the model does not have: ", first_of(unexpected),
                    " (it was saved from another architecture)");
  return out;
}

// Pending gradients by parameter id; `dtype_of` gives each one's expected dtype.
std::vector<at::Tensor> gradients_by_id(const std::string& path, const std::string& what, const Reader& r,
                                        const std::string& key, const std::vector<HostParam>& params,
                                        const std::function<c10::optional<at::ScalarType>(const HostParam&)>& dtype_of) {
  std::unordered_map<std::string, size_t> id_of;
  for (size_t i = 0; i < params.size(); ++i) id_of[params[i].name] = i;
  std::vector<at::Tensor> out(params.size());
  for (auto& [name, t] : r.named(key)) {
    auto it = id_of.find(name);
    TORCH_CHECK_VALUE(it != id_of.end(), "load_checkpoint: '", path, "': ", what, " for '", name,
                      "', which the model does not have (another architecture?)");
    const HostParam& p = params[it->second];
    const c10::optional<at::ScalarType> dtype = dtype_of(p);
    TORCH_CHECK_VALUE(dtype.has_value() && t.sizes() == p.master.sizes() && t.scalar_type() == *dtype,
                      "load_checkpoint: '", path, "': ", what, " for '", name, "' has shape ", t.sizes(),
                      " and dtype ", t.scalar_type(), ", which do not fit the model's parameter");
    out[it->second] = t;
  }
  return out;
}

std::string archive_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive ar;
  optimizer.save(ar);
  std::ostringstream os;
  ar.save_to(os);
  return os.str();
}

void load_archive_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes) {
  torch::serialize::InputArchive ar;
  ar.load_from(bytes.data(), bytes.size());
  optimizer.load(ar);
}

void write_checkpoint_file(const std::string& path, torch::serialize::OutputArchive& ar) {
  CheckpointFileWriter writer(path);
  // An interrupt stops the writing (the archive writer calls back from C
  // code, which must not be unwound through): the rest of the archive is
  // dropped, and the writer is never committed, so no file is left.
  std::exception_ptr interrupt;
  auto polled = std::chrono::steady_clock::now();
  ar.save_to([&](const void* data, size_t size) -> size_t {
    if (!interrupt && interruptible() && std::chrono::steady_clock::now() - polled >= kInterruptPollPeriod) {
      polled = std::chrono::steady_clock::now();
      try {
        interrupt = poll_interrupt();
      } catch (...) {
        interrupt = std::current_exception();
      }
      if (interrupt) writer.discard();
    }
    return writer.write(data, size);
  });
  if (interrupt) std::rethrow_exception(interrupt);
  writer.check_written();
  writer.commit();
}

}  // namespace

void quiesce_for_checkpoint(RoundPipe::Impl& model) {
  ModelUseLock::Scope use(model.use(), "save_checkpoint");
  model.quiesce();
}

void save_checkpoint_with(const std::string& path, RoundPipe::Impl& m, const CheckpointState& state,
                          const std::string* extra) {
  TORCH_CHECK_VALUE(!path.empty(), "save_checkpoint: the path is empty");
  ModelUseLock::Scope use(m.use(), "save_checkpoint");
  // The step in flight finishes, but its result stays out of the masters:
  // the next calls must still see θ_{k-1}. Both generations are saved.
  m.quiesce();
  const RoundPipe::Impl::State engine = m.export_state();
  if (ProcessGroup* group = m.process_group()) {
    // Gradients not yet combined differ between the processes: they would
    // be lost (or counted as rank 0's only) on resume.
    const auto& params = m.params();
    for (size_t id = 0; id < params.size(); ++id) {
      TORCH_CHECK_VALUE(!engine.accumulated[id].defined() && !engine.master_grad[id].defined(),
                        "save_checkpoint: with a process group, save after step(): '", params[id].name,
                        "' has gradients of calls that no step handed to the optimizer yet, and they differ "
                        "between the processes");
    }
    // The state is the same on every process: rank 0 writes it.
    if (group->rank() != 0) return;
  }

  torch::serialize::OutputArchive ar;
  ar.write("format", c10::IValue(std::string(kFormat)));
  ar.write("version", c10::IValue(kVersion));
  std::vector<std::pair<std::string, at::Tensor>> masters = m.named_state(), copies, accum, grads,
                                                   optim_grads;
  const auto& params = m.params();
  for (size_t id = 0; id < params.size(); ++id) {
    const HostParam& p = params[id];
    if (p.optim.defined()) copies.emplace_back(p.name, p.optim);
    if (engine.accumulated[id].defined()) accum.emplace_back(p.name, engine.accumulated[id]);
    if (engine.master_grad[id].defined()) grads.emplace_back(p.name, engine.master_grad[id]);
    if (engine.optim_grad[id].defined()) optim_grads.emplace_back(p.name, engine.optim_grad[id]);
  }
  write_named(ar, "state", masters);
  write_named(ar, "optim", copies);
  write_named(ar, "accum", accum);
  write_named(ar, "grad", grads);
  write_named(ar, "optim_grad", optim_grads);
  ar.write("engine", c10::List<int64_t>({m.num_layers(), static_cast<int64_t>(engine.pipeline.seed),
                                         engine.pipeline.next_call_id, engine.optimizer.steps_issued,
                                         engine.optimizer.model_behind ? 1 : 0}));
  c10::List<bool> warmed;
  c10::List<int64_t> count;
  c10::List<double> mean;
  for (const ModelTimer::Entry& e : engine.timer) {
    warmed.push_back(e.warmed_up);
    count.push_back(e.count);
    mean.push_back(e.biased_mean);
  }
  ar.write("timer_warmed", warmed);
  ar.write("timer_count", count);
  ar.write("timer_mean", mean);
  ar.write("user", c10::List<int64_t>({state.step}));
  c10::Dict<std::string, int64_t> extra_state;
  for (const auto& [key, value] : state.extra_state) extra_state.insert(key, value);
  ar.write("extra_state", extra_state);
  ar.write("metadata_json", c10::IValue(state.metadata_json));
  if (state.optimizer != nullptr) {
    torch::serialize::OutputArchive opt;
    state.optimizer->save(opt);
    ar.write("optimizer", opt);
  }
  if (state.scaler != nullptr) {
    c10::Dict<std::string, double> floats;
    c10::Dict<std::string, int64_t> ints;
    for (const auto& entry : state.scaler->state_dict()) {
      if (entry.value().isDouble()) {
        floats.insert(entry.key(), entry.value().toDouble());
      } else {
        TORCH_INTERNAL_ASSERT(entry.value().isInt(), "GradScaler state entry '", entry.key(),
                              "' is neither float nor int");
        ints.insert(entry.key(), entry.value().toInt());
      }
    }
    ar.write("scaler_float", floats);
    ar.write("scaler_int", ints);
  }
  if (extra != nullptr) {
    // Viewed, not copied: the archive only reads it.
    ar.write("extra", at::from_blob(const_cast<char*>(extra->data()), {static_cast<int64_t>(extra->size())},
                                    at::TensorOptions().dtype(at::kByte)));
  }

  try {
    write_checkpoint_file(path, ar);
  } catch (const FileError& e) {
    throw FileError(e.error_number(), e.path(), std::string("save_checkpoint: ") + e.what_without_backtrace());
  }
}

PendingCheckpoint read_checkpoint(const std::string& path, const std::shared_ptr<RoundPipe::Impl>& model) {
  RoundPipe::Impl& m = *model;
  ModelUseLock::Scope use(m.use(), "load_checkpoint");
  m.quiesce();
  torch::serialize::InputArchive ar;
  read_checkpoint_file(path, ar);
  Reader r{path, ar};
  c10::IValue format = r.get("format"), version = r.get("version");
  if (!format.isString() || format.toStringRef() != kFormat) r.damaged("it has no roundpipe checkpoint format tag");
  TORCH_CHECK_VALUE(version.isInt() && (version.toInt() == kVersion || version.toInt() == 1),
                    "load_checkpoint: '", path, "' has checkpoint version ", version,
                    "; this roundpipe reads versions 1 to ", kVersion);
  const bool version1 = version.toInt() == 1;

  PendingCheckpoint out;
  out.path = path;
  out.model = model;
  const std::vector<int64_t> engine = r.ints("engine");
  if (engine.size() != 5) r.damaged("entry 'engine' has the wrong length");
  TORCH_CHECK_VALUE(engine[0] == m.num_layers(), "load_checkpoint: '", path, "' holds a model of ", engine[0],
                    " layers; this model has ", m.num_layers(), " (another architecture)");
  out.seed = static_cast<uint64_t>(engine[1]);
  out.next_call_id = engine[2];
  out.steps_issued = engine[3];
  out.model_behind_optimizer = engine[4] != 0;
  if (out.next_call_id < 0 || out.steps_issued < 0) r.damaged("negative engine counters");

  std::vector<std::pair<std::string, at::Tensor>> masters = m.named_state(), copies;
  for (const HostParam& p : m.params()) {
    if (p.optim.defined()) copies.emplace_back(p.name, p.optim);
  }
  out.copies = match(path, "parameter or buffer", masters, r.named("state"));
  for (auto& c : match(path, "optimizer copy", copies, r.named("optim"))) out.copies.push_back(std::move(c));

  const auto& params = m.params();
  out.accum = gradients_by_id(path, "a pending gradient", r, "accum", params,
                              [](const HostParam& p) { return c10::optional<at::ScalarType>(gradient_sum_dtype(p)); });
  out.master_grad = gradients_by_id(path, "a parameter .grad", r, "grad", params, [](const HostParam& p) {
    return c10::optional<at::ScalarType>(p.master.scalar_type());
  });
  out.optim_grad = gradients_by_id(path, "an optimizer copy .grad", r, "optim_grad", params, [](const HostParam& p) {
    return p.optim.defined() ? c10::optional<at::ScalarType>(p.optim.scalar_type()) : c10::nullopt;
  });

  c10::IValue warmed = r.get("timer_warmed"), mean = r.get("timer_mean");
  const std::vector<int64_t> count = r.ints("timer_count");
  if (!warmed.isBoolList() || !mean.isDoubleList()) r.damaged("the timer entries have the wrong types");
  const auto warmed_v = warmed.toBoolList();
  const auto mean_v = mean.toDoubleVector();
  if (warmed_v.size() != count.size() || mean_v.size() != count.size()) r.damaged("the timer entries differ in length");
  for (size_t i = 0; i < count.size(); ++i) out.timer.push_back({warmed_v.get(i), count[i], mean_v[i]});
  ModelTimer(m.num_layers()).load_state(out.timer);  // checks it: ValueError naming what is wrong

  const std::vector<int64_t> user = r.ints("user");
  if (user.size() != (version1 ? 4u : 1u)) r.damaged("entry 'user' has the wrong length");
  out.step = user[0];
  if (version1)
    out.extra_state = {{"data.seed", user[1]}, {"data.epoch", user[2]}, {"data.index", user[3]}};
  c10::IValue extra_state =
      version1 ? c10::IValue(c10::Dict<std::string, int64_t>()) : r.get("extra_state");
  if (!extra_state.isGenericDict()) r.damaged("entry 'extra_state' is not a dict");
  for (const auto& entry : extra_state.toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isInt())
      r.damaged("entry 'extra_state' is not a dict of str to int");
    out.extra_state[entry.key().toStringRef()] = entry.value().toInt();
  }
  c10::IValue metadata = r.get("metadata_json");
  if (!metadata.isString()) r.damaged("entry 'metadata_json' is not a string");
  out.metadata_json = metadata.toStringRef();

  auto optimizer = std::make_unique<torch::serialize::InputArchive>();
  bool has_optimizer = false;
  try {
    has_optimizer = ar.try_read("optimizer", *optimizer);
  } catch (const std::exception& e) {
    r.damaged(std::string("the optimizer state cannot be read: ") + message_of(e));
  }
  if (has_optimizer) out.optimizer = std::move(optimizer);
  c10::IValue floats, ints;
  if (ar.try_read("scaler_float", floats)) {
    ints = r.get("scaler_int");
    if (!floats.isGenericDict() || !ints.isGenericDict()) r.damaged("the scaler state has the wrong types");
    auto scaler = c10::impl::toTypedDict<std::string, c10::IValue>(
        c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
    for (const auto& e : floats.toGenericDict()) {
      if (!e.key().isString() || !e.value().isDouble()) r.damaged("the scaler state has the wrong types");
      scaler.insert(e.key().toStringRef(), e.value());
    }
    for (const auto& e : ints.toGenericDict()) {
      if (!e.key().isString() || !e.value().isInt()) r.damaged("the scaler state has the wrong types");
      scaler.insert(e.key().toStringRef(), e.value());
    }
    out.scaler = std::move(scaler);
  }
  c10::IValue extra;
  if (ar.try_read("extra", extra)) {
    if (!extra.isTensor() || extra.toTensor().scalar_type() != at::kByte || extra.toTensor().dim() != 1) {
      r.damaged("entry 'extra' is not a byte tensor");
    }
    const at::Tensor bytes = extra.toTensor().contiguous();
    out.extra.assign(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
    out.has_extra = true;
  }
  return out;
}

void PendingCheckpoint::apply() {
  RoundPipe::Impl& m = *model;
  ModelUseLock::Scope use(m.use(), "load_checkpoint");
  // Nothing may run while the state is replaced (a step's error stays for
  // the next call).
  m.quiesce(/*raise_step_error=*/false);
  at::NoGradGuard no_grad;
  for (auto& [dst, src] : copies) dst.detach().copy_(src);
  RoundPipe::Impl::State state;
  state.pipeline = {seed, next_call_id};
  state.optimizer = {steps_issued, model_behind_optimizer};
  state.timer = timer;
  state.accumulated = accum;
  state.master_grad = master_grad;
  state.optim_grad = optim_grad;
  m.import_state(std::move(state));
}

}  // namespace detail

void save_checkpoint(const std::string& path, RoundPipe& model, const CheckpointState& state) {
  detail::save_checkpoint_with(path, *detail::EngineAccess::impl(model), state, nullptr);
}

void load_checkpoint(const std::string& path, RoundPipe& model, CheckpointState& state) {
  // One call: the optimizer's and scaler's loads belong to it.
  ModelUseLock::Scope use(detail::EngineAccess::impl(model)->use(), "load_checkpoint");
  detail::PendingCheckpoint pending =
      detail::read_checkpoint(path, detail::EngineAccess::impl(model));
  TORCH_CHECK_VALUE(state.optimizer == nullptr || pending.optimizer != nullptr, "load_checkpoint: '", path,
                    "' holds no optimizer state (it was saved without CheckpointState::optimizer)");
  TORCH_CHECK_VALUE(state.scaler == nullptr || pending.scaler.has_value(), "load_checkpoint: '", path,
                    "' holds no GradScaler state (it was saved without CheckpointState::scaler)");
  // The optimizer and the scaler may still refuse their state: keep what
  // they had, to put it back then.
  std::string optimizer_before;
  if (state.optimizer != nullptr) {
    optimizer_before = detail::archive_bytes(*state.optimizer);
    try {
      state.optimizer->load(*pending.optimizer);
      // libtorch's loader moves each saved state to the parameters listed
      // under its key; a key listed twice leaves an empty state behind.
      for (const auto& entry : state.optimizer->state()) {
        TORCH_CHECK_VALUE(entry.second != nullptr, "a parameter's saved state is listed twice");
      }
    } catch (const std::exception& e) {
      // A load that failed part-way may have left entries (even empty ones)
      // in the state, which loading the old bytes would only add to.
      state.optimizer->state().clear();
      detail::load_archive_bytes(*state.optimizer, optimizer_before);
      TORCH_CHECK_VALUE(false, "load_checkpoint: '", path, "': the saved optimizer state does not fit this optimizer (",
                        detail::message_of(e), "); build it over model.optim_parameters() as when saving");
    }
  }
  if (state.scaler != nullptr) {
    const c10::Dict<std::string, c10::IValue> scaler_before = state.scaler->state_dict();
    try {
      state.scaler->load_state_dict(*pending.scaler);
    } catch (const std::exception& e) {
      if (!scaler_before.empty()) state.scaler->load_state_dict(scaler_before);
      if (state.optimizer != nullptr) detail::load_archive_bytes(*state.optimizer, optimizer_before);
      TORCH_CHECK_VALUE(false, "load_checkpoint: '", path, "': the saved GradScaler state does not fit this scaler (",
                        detail::message_of(e), ")");
    }
  }
  pending.apply();
  state.step = pending.step;
  state.extra_state = pending.extra_state;
  state.metadata_json = pending.metadata_json;
}

}  // namespace roundpipe
