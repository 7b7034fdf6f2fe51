// Splitting call inputs into microbatches and merging their outputs
// (roundpipe/microbatch.h).
#include <roundpipe/microbatch.h>

#include "batch/batch_split.h"

#include <ATen/ATen.h>

#include <unordered_map>
#include <unordered_set>

#include "util/value_tree.h"

namespace roundpipe {

// ---------------------------------------------------------------------------
// Spec factories.

Spec Spec::tuple(std::vector<Spec> items) {
  Spec s;
  s.kind_ = Kind::kTuple;
  s.items_ = std::move(items);
  return s;
}

Spec Spec::list(std::vector<Spec> items) {
  Spec s;
  s.kind_ = Kind::kList;
  s.items_ = std::move(items);
  return s;
}

Spec Spec::dict(std::vector<std::pair<std::string, Spec>> items) {
  Spec s;
  s.kind_ = Kind::kDict;
  std::unordered_set<std::string> seen;
  for (auto& [key, spec] : items) {
    TORCH_CHECK_VALUE(seen.insert(key).second, "Spec::dict: duplicate key '", key, "'");
    s.keys_.push_back(key);
    s.items_.push_back(std::move(spec));
  }
  return s;
}

Spec TensorChunkSpec(int64_t dim) {
  Spec s;
  s.kind_ = Spec::Kind::kChunk;
  s.dim_ = dim;
  return s;
}

Spec Replicate() {
  Spec s;
  s.kind_ = Spec::Kind::kReplicate;
  return s;
}

Spec CustomReducer(c10::IValue init, Spec::ReduceFn fn) {
  TORCH_CHECK_VALUE(static_cast<bool>(fn), "CustomReducer: the reduce function is empty");
  Spec s;
  s.kind_ = Spec::Kind::kReducer;
  s.init_ = std::move(init);
  s.reduce_fn_ = std::move(fn);
  return s;
}

// ---------------------------------------------------------------------------
// MicrobatchValues.

namespace {
// Registered in this file so that any user of make_microbatch_values links the
// registration in: an IValue can only hold a registered custom class.
const auto kMicrobatchValuesClass =
    torch::class_<MicrobatchValues>("roundpipe", "MicrobatchValues");
}  // namespace

Kwargs make_kwargs(std::vector<std::pair<std::string, c10::IValue>> items) {
  // Dict<std::string, IValue> has no public constructor; go through GenericDict.
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  for (auto& [key, value] : items) dict.insert_or_assign(key, std::move(value));
  return c10::impl::toTypedDict<std::string, c10::IValue>(std::move(dict));
}

c10::IValue make_microbatch_values(std::vector<c10::IValue> items) {
  return c10::IValue(c10::make_intrusive<MicrobatchValues>(std::move(items)));
}

c10::intrusive_ptr<MicrobatchValues> as_microbatch_values(const c10::IValue& v) {
  if (!v.isObject()) return {};
  static const auto type = c10::getCustomClassType<c10::intrusive_ptr<MicrobatchValues>>();
  if (v.toObjectRef().type().get() != type.get()) return {};
  return v.toCustomClass<MicrobatchValues>();
}

namespace {

using Pieces = std::vector<c10::IValue>;  // one value per microbatch

const Spec& auto_spec() {
  static const Spec spec;
  return spec;
}

// ---------------------------------------------------------------------------
// Value trees.

bool is_str_dict(const c10::IValue& v) {
  return v.isGenericDict() && v.toGenericDict().keyType()->kind() == c10::TypeKind::StringType;
}

bool is_container(const c10::IValue& v) { return v.isTuple() || v.isList() || is_str_dict(v); }

size_t container_size(const c10::IValue& v) {
  if (v.isTuple()) return v.toTupleRef().elements().size();
  if (v.isList()) return v.toListRef().size();
  return v.toGenericDict().size();
}

// A short description of a value for error messages.
std::string describe(const c10::IValue& v) {
  if (v.isTuple()) return c10::str("a tuple of ", container_size(v), " items");
  if (v.isList()) return c10::str("a list of ", container_size(v), " items");
  if (is_str_dict(v)) return c10::str("a dict with ", container_size(v), " keys");
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return "an undefined tensor";
    return c10::str("a tensor of shape ", t.sizes());
  }
  if (as_microbatch_values(v)) return "a MicrobatchValues";
  return c10::str("a value of kind ", v.tagKind());
}

// One child of a container: where it sits, for lookups in sibling trees.
struct Child {
  std::string path;
  size_t index = 0;  // tuple / list
  std::string key;   // dict
};

// The children of a container, in its order.
std::vector<Child> children_of(const c10::IValue& v, const std::string& path) {
  std::vector<Child> out;
  if (is_str_dict(v)) {
    for (const auto& entry : v.toGenericDict()) {
      const std::string& key = entry.key().toStringRef();
      out.push_back({c10::str(path, "['", key, "']"), 0, key});
    }
  } else {
    for (size_t i = 0; i < container_size(v); ++i)
      out.push_back({c10::str(path, "[", i, "]"), i, ""});
  }
  return out;
}

c10::IValue child_at(const c10::IValue& v, const Child& c) {
  if (v.isTuple()) return v.toTupleRef().elements()[c.index];
  if (v.isList()) return v.toListRef()[c.index];
  return v.toGenericDict().at(c.key);
}

// Element type for a rebuilt container: the original one while every element
// still fits it (a TensorList stays a TensorList), else Any.
c10::TypePtr fitting_type(const c10::TypePtr& type, const std::vector<c10::IValue>& elems) {
  if (type->kind() == c10::TypeKind::AnyType) return type;
  for (const auto& e : elems) {
    if (!e.type()->isSubtypeOf(*type)) return c10::AnyType::get();
  }
  return type;
}

// A container of proto's kind (and dict keys, in order) holding `elems`.
c10::IValue rebuild(const c10::IValue& proto, std::vector<c10::IValue> elems) {
  if (proto.isTuple()) return c10::ivalue::Tuple::create(std::move(elems));
  if (proto.isList()) {
    c10::impl::GenericList list(fitting_type(proto.toList().elementType(), elems));
    list.reserve(elems.size());
    for (auto& e : elems) list.push_back(std::move(e));
    return list;
  }
  const auto dict = proto.toGenericDict();
  c10::impl::GenericDict out(dict.keyType(), fitting_type(dict.valueType(), elems));
  size_t i = 0;
  for (const auto& entry : dict) out.insert(entry.key(), std::move(elems[i++]));
  return out;
}

// n containers shaped like proto; child c of container m is pieces[c][m].
Pieces transpose(const c10::IValue& proto, const std::vector<Pieces>& pieces, int64_t n) {
  Pieces out;
  for (int64_t m = 0; m < n; ++m) {
    std::vector<c10::IValue> elems;
    elems.reserve(pieces.size());
    for (const auto& p : pieces) elems.push_back(p[m]);
    out.push_back(rebuild(proto, std::move(elems)));
  }
  return out;
}

// The spec of each child of `v` (in v's order), checking that v has the
// structure `spec` describes.
std::vector<const Spec*> match_structure(const c10::IValue& v, const Spec& spec,
                                         const std::string& path) {
  const auto& items = spec.items();
  std::vector<const Spec*> out;
  if (spec.kind() == Spec::Kind::kDict) {
    TORCH_CHECK_VALUE(is_str_dict(v) && container_size(v) == items.size(), path,
                      ": spec expects a dict with ", items.size(), " keys, got ", describe(v));
    std::unordered_map<std::string, const Spec*> by_key;
    for (size_t i = 0; i < items.size(); ++i) by_key[spec.keys()[i]] = &items[i];
    for (const auto& entry : v.toGenericDict()) {
      auto it = by_key.find(entry.key().toStringRef());
      TORCH_CHECK_VALUE(it != by_key.end(), path, ": spec has no key '", entry.key().toStringRef(),
                        "' of the dict");
      out.push_back(it->second);
    }
    return out;
  }
  const bool tuple = spec.kind() == Spec::Kind::kTuple;
  TORCH_CHECK_VALUE((tuple ? v.isTuple() : v.isList()) && container_size(v) == items.size(), path,
                    ": spec expects a ", tuple ? "tuple" : "list", " of ", items.size(),
                    " items, got ", describe(v));
  for (const auto& s : items) out.push_back(&s);
  return out;
}

// Checks that microbatch m's container has the same structure as microbatch 0's.
void check_same_structure(const c10::IValue& v0, const c10::IValue& vm, size_t m,
                          const std::string& path) {
  const bool same_kind = (v0.isTuple() && vm.isTuple()) || (v0.isList() && vm.isList()) ||
                         (is_str_dict(v0) && is_str_dict(vm));
  TORCH_CHECK_VALUE(same_kind && container_size(v0) == container_size(vm), path,
                    ": microbatch 0 is ", describe(v0), " but microbatch ", m, " is ",
                    describe(vm));
  if (!is_str_dict(v0)) return;
  const auto dm = vm.toGenericDict();
  for (const auto& entry : v0.toGenericDict()) {
    TORCH_CHECK_VALUE(dm.contains(entry.key()), path, ": key '", entry.key().toStringRef(),
                      "' is in microbatch 0 but not in microbatch ", m);
  }
}

// ---------------------------------------------------------------------------
// Split.

// The rows of the first tensor split, which every other one split must
// share (a batch of 6 inputs and 3 labels is a mistake, not 3 microbatches of
// uneven halves).
struct SplitRows {
  c10::optional<int64_t> rows;
  std::string path;  // of the tensor that set them

  void note(const std::string& at, int64_t dim, int64_t n) {
    if (!rows) {
      rows = n;
      path = at;
      return;
    }
    TORCH_CHECK_VALUE(*rows == n, at, " has ", n, " rows along dim ", dim, " but ", path, " has ", *rows,
                      ": the tensors split into microbatches must share their batch size (give a "
                      "tensor that is not batched Replicate() in split_input / split_label)");
  }
};

struct SplitContext {
  int64_t n;
  // Set while splitting kwargs: automatic tensors whose dim 0 differs from the
  // call's batch size are replicated rather than split.
  c10::optional<int64_t> batch_size;
  SplitRows* rows = nullptr;  // null: not checked
};

Pieces replicate(const c10::IValue& v, int64_t n) { return Pieces(n, v); }

Pieces distribute(const MicrobatchValues& mv, int64_t n, const std::string& path) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(mv.items.size()) == n, path, ": MicrobatchValues holds ",
                    mv.items.size(), " items, expected ", n, " microbatches");
  return mv.items;
}

// Views (no copy, no detach) so that gradients reach the original tensor.
Pieces chunk(const at::Tensor& t, int64_t dim, int64_t n, const std::string& path) {
  TORCH_CHECK_VALUE(t.size(dim) >= n, path, ": cannot split a tensor of shape ", t.sizes(),
                    " along dim ", dim, " into ", n, " microbatches (fewer than ", n, " rows)");
  Pieces out;
  for (auto& piece : at::tensor_split(t, n, dim)) out.emplace_back(std::move(piece));
  return out;
}

Pieces split_value(const c10::IValue& v, const Spec& spec, const std::string& path,
                   const SplitContext& ctx);

Pieces split_children(const c10::IValue& v, const std::vector<const Spec*>& specs,
                      const std::string& path, const SplitContext& ctx) {
  const auto children = children_of(v, path);
  std::vector<Pieces> pieces;
  for (size_t i = 0; i < children.size(); ++i) {
    const Spec& spec = specs.empty() ? auto_spec() : *specs[i];
    pieces.push_back(split_value(child_at(v, children[i]), spec, children[i].path, ctx));
  }
  return transpose(v, pieces, ctx.n);
}

Pieces split_auto(const c10::IValue& v, const std::string& path, const SplitContext& ctx) {
  if (is_container(v)) return split_children(v, {}, path, ctx);
  if (!v.isTensor()) return replicate(v, ctx.n);
  const at::Tensor& t = v.toTensor();
  if (!t.defined() || t.dim() == 0) return replicate(v, ctx.n);
  if (ctx.batch_size && t.size(0) != *ctx.batch_size) return replicate(v, ctx.n);
  if (ctx.rows) ctx.rows->note(path, 0, t.size(0));
  return chunk(t, 0, ctx.n, path);
}

Pieces split_value(const c10::IValue& v, const Spec& spec, const std::string& path,
                   const SplitContext& ctx) {
  const Spec::Kind kind = spec.kind();
  // Already split: any leaf spec hands out its items (replicating the holder
  // itself would give the model an opaque object).
  if (kind == Spec::Kind::kAuto || kind == Spec::Kind::kChunk || kind == Spec::Kind::kReplicate) {
    if (auto mv = as_microbatch_values(v)) return distribute(*mv, ctx.n, path);
  }
  switch (kind) {
    case Spec::Kind::kAuto:
      return split_auto(v, path, ctx);
    case Spec::Kind::kReplicate:
      return replicate(v, ctx.n);
    case Spec::Kind::kReducer:
      C10_THROW_ERROR(ValueError,
                      c10::str(path, ": CustomReducer is for merging outputs, not for splitting"));
    case Spec::Kind::kChunk: {
      const bool ok = v.isTensor() && v.toTensor().defined() && v.toTensor().dim() > 0;
      TORCH_CHECK_VALUE(ok, path, ": TensorChunkSpec(", spec.dim(), ") needs a tensor, got ",
                        describe(v));
      const at::Tensor& t = v.toTensor();
      const int64_t dim = spec.dim() < 0 ? spec.dim() + t.dim() : spec.dim();
      TORCH_CHECK_VALUE(dim >= 0 && dim < t.dim(), path, ": TensorChunkSpec(", spec.dim(),
                        ") is out of range for ", describe(v));
      if (ctx.rows) ctx.rows->note(path, dim, t.size(dim));
      return chunk(t, dim, ctx.n, path);
    }
    default:
      return split_children(v, match_structure(v, spec, path), path, ctx);
  }
}

// ---------------------------------------------------------------------------
// Merge.

bool tensors_equal(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  return a.scalar_type() == b.scalar_type() && a.device() == b.device() && a.sizes() == b.sizes() &&
         at::equal(a, b);
}

bool leaves_equal(const c10::IValue& a, const c10::IValue& b) {
  if (a.isTensor() || b.isTensor()) {
    return a.isTensor() && b.isTensor() && tensors_equal(a.toTensor(), b.toTensor());
  }
  if (a.isObject() || b.isObject()) return a.isSameIdentity(b);
  if (a.isCapsule() || b.isCapsule()) {
    if (!a.isCapsule() || !b.isCapsule()) return false;
    auto* x = dynamic_cast<const OpaqueLeaf*>(a.toCapsule().get());
    auto* y = dynamic_cast<const OpaqueLeaf*>(b.toCapsule().get());
    return x != nullptr && y != nullptr ? x->equals(*y) : a.isSameIdentity(b);
  }
  try {
    return a == b;
  } catch (const c10::Error&) {  // e.g. a leaf dict holding tensors
    return false;
  }
}

void check_all_equal(const Pieces& vals, const std::string& path) {
  for (size_t m = 1; m < vals.size(); ++m) {
    TORCH_CHECK_VALUE(leaves_equal(vals[0], vals[m]), path, ": microbatch 0 and microbatch ", m,
                      " returned different values (", describe(vals[0]), " vs ", describe(vals[m]),
                      "); only tensors can be merged");
  }
}

std::vector<at::Tensor> tensors_of(const Pieces& vals, const std::string& path, bool need_dims) {
  std::vector<at::Tensor> out;
  for (size_t m = 0; m < vals.size(); ++m) {
    const bool ok = vals[m].isTensor() && vals[m].toTensor().defined() &&
                    (!need_dims || vals[m].toTensor().dim() > 0);
    TORCH_CHECK_VALUE(ok, path, ": microbatch ", m, " is ", describe(vals[m]), ", expected a ",
                      need_dims ? "tensor with at least one dimension" : "tensor");
    out.push_back(vals[m].toTensor());
  }
  return out;
}

c10::IValue concat(const std::vector<at::Tensor>& ts, int64_t dim, const std::string& path) {
  if (ts.size() == 1) return ts[0];
  try {
    return at::cat(ts, dim);
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(ValueError, c10::str(path, ": cannot concatenate microbatch outputs along dim ",
                                         dim, ": ", e.what_without_backtrace()));
  }
}

c10::IValue merge_tensors_auto(const Pieces& vals, const std::string& path) {
  const at::Tensor& t0 = vals[0].toTensor();
  if (!t0.defined()) {
    check_all_equal(vals, path);
    return vals[0];
  }
  if (t0.dim() > 0) return concat(tensors_of(vals, path, true), 0, path);
  const auto ts = tensors_of(vals, path, false);
  for (size_t m = 1; m < ts.size(); ++m) {
    TORCH_CHECK_VALUE(ts[m].dim() == 0, path, ": microbatch 0 is a scalar tensor but microbatch ",
                      m, " is ", describe(vals[m]));
  }
  // Floating scalars (losses, metrics) are averaged; others must agree.
  if (!t0.is_floating_point() && !t0.is_complex()) {
    check_all_equal(vals, path);
    return vals[0];
  }
  if (ts.size() == 1) return vals[0];
  return at::stack(ts).mean(0);
}

c10::IValue merge_value(const Pieces& vals, const Spec& spec, const std::string& path);

c10::IValue merge_children(const Pieces& vals, const std::vector<const Spec*>& specs,
                           const std::string& path) {
  const auto children = children_of(vals[0], path);
  std::vector<c10::IValue> merged;
  for (size_t i = 0; i < children.size(); ++i) {
    Pieces child;
    for (const auto& v : vals) child.push_back(child_at(v, children[i]));
    const Spec& spec = specs.empty() ? auto_spec() : *specs[i];
    merged.push_back(merge_value(child, spec, children[i].path));
  }
  return rebuild(vals[0], std::move(merged));
}

c10::IValue merge_auto(const Pieces& vals, const std::string& path) {
  if (is_container(vals[0])) {
    for (size_t m = 1; m < vals.size(); ++m) check_same_structure(vals[0], vals[m], m, path);
    return merge_children(vals, {}, path);
  }
  if (vals[0].isTensor()) return merge_tensors_auto(vals, path);
  check_all_equal(vals, path);
  return vals[0];
}

c10::IValue merge_value(const Pieces& vals, const Spec& spec, const std::string& path) {
  switch (spec.kind()) {
    case Spec::Kind::kAuto:
      return merge_auto(vals, path);
    case Spec::Kind::kReplicate:
      return vals[0];
    case Spec::Kind::kReducer: {
      c10::IValue acc = spec.init();
      for (const auto& v : vals) acc = spec.reduce_fn()(acc, v);
      return acc;
    }
    case Spec::Kind::kChunk: {
      const auto ts = tensors_of(vals, path, true);
      const int64_t ndim = ts[0].dim();
      const int64_t dim = spec.dim() < 0 ? spec.dim() + ndim : spec.dim();
      TORCH_CHECK_VALUE(dim >= 0 && dim < ndim, path, ": TensorChunkSpec(", spec.dim(),
                        ") is out of range for ", describe(vals[0]));
      return concat(ts, dim, path);
    }
    default: {
      // Matching every microbatch against the spec also makes them match each other.
      const auto specs = match_structure(vals[0], spec, c10::str(path, " (microbatch 0)"));
      for (size_t m = 1; m < vals.size(); ++m) {
        match_structure(vals[m], spec, c10::str(path, " (microbatch ", m, ")"));
      }
      return merge_children(vals, specs, path);
    }
  }
}

// merge == false: microbatch 0's structure with MicrobatchValues leaves.
c10::IValue unmerged(const Pieces& vals, const std::string& path) {
  if (!is_container(vals[0])) return make_microbatch_values(vals);
  for (size_t m = 1; m < vals.size(); ++m) check_same_structure(vals[0], vals[m], m, path);
  std::vector<c10::IValue> elems;
  for (const auto& c : children_of(vals[0], path)) {
    Pieces child;
    for (const auto& v : vals) child.push_back(child_at(v, c));
    elems.push_back(unmerged(child, c.path));
  }
  return rebuild(vals[0], std::move(elems));
}

// Depth-first; MicrobatchValues are already split, so they are skipped.
c10::optional<int64_t> first_batch_size(const c10::IValue& v) {
  if (is_container(v)) {
    for (const auto& c : children_of(v, "")) {
      if (auto b = first_batch_size(child_at(v, c))) return b;
    }
    return c10::nullopt;
  }
  if (v.isTensor() && v.toTensor().defined() && v.toTensor().dim() > 0) {
    return v.toTensor().size(0);
  }
  return c10::nullopt;
}

// The rows the first split tensor of `v` has along its split dim: dim 0 for
// automatic subtrees, the spec's dim for TensorChunkSpec leaves; nullopt when
// nothing in `v` is split.
c10::optional<int64_t> first_split_rows(const c10::IValue& v, const Spec& spec) {
  if (as_microbatch_values(v)) return c10::nullopt;
  switch (spec.kind()) {
    case Spec::Kind::kAuto:
      return first_batch_size(v);
    case Spec::Kind::kReplicate:
    case Spec::Kind::kReducer:
      return c10::nullopt;
    case Spec::Kind::kChunk: {
      if (!v.isTensor() || !v.toTensor().defined() || v.toTensor().dim() == 0) return c10::nullopt;
      const at::Tensor& t = v.toTensor();
      const int64_t dim = spec.dim() < 0 ? spec.dim() + t.dim() : spec.dim();
      if (dim < 0 || dim >= t.dim()) return c10::nullopt;  // split_value reports it
      return t.size(dim);
    }
    default: {
      const auto children = children_of(v, "");
      const auto specs = match_structure(v, spec, "");
      for (size_t i = 0; i < children.size(); ++i) {
        const Spec& child = specs.empty() ? auto_spec() : *specs[i];
        if (auto b = first_split_rows(child_at(v, children[i]), child)) return b;
      }
      return c10::nullopt;
    }
  }
}

void check_num_microbatches(int64_t n) {
  TORCH_CHECK_VALUE(n >= 1, "the number of microbatches must be at least 1, got ", n);
}

}  // namespace

// ---------------------------------------------------------------------------
// Public entry points.

c10::optional<int64_t> find_batch_size(const std::vector<c10::IValue>& args, const Kwargs& kwargs) {
  for (const auto& a : args) {
    if (auto b = first_batch_size(a)) return b;
  }
  for (const auto& entry : kwargs) {
    if (auto b = first_batch_size(entry.value())) return b;
  }
  return c10::nullopt;
}

c10::optional<int64_t> split_batch_size(const std::vector<c10::IValue>& args, const Kwargs& kwargs,
                                        const InputSplit& how) {
  if (how.fn) return c10::nullopt;
  if (!how.args_spec && !how.kwargs_spec) return find_batch_size(args, kwargs);
  try {
    for (size_t i = 0; i < args.size(); ++i) {
      const Spec& spec = how.args_spec && i < how.args_spec->size() ? (*how.args_spec)[i] : auto_spec();
      if (auto b = first_split_rows(args[i], spec)) return b;
    }
    for (const auto& entry : kwargs) {
      const Spec* spec = &auto_spec();
      if (how.kwargs_spec) {
        for (const auto& [key, s] : *how.kwargs_spec) {
          if (key == entry.key()) spec = &s;
        }
      }
      if (auto b = first_split_rows(entry.value(), *spec)) return b;
    }
  } catch (const c10::Error&) {
    // A spec that does not fit the inputs: the split itself says what is wrong.
  }
  return c10::nullopt;
}

static MicrobatchInputs split_inputs_unnamed(const std::vector<c10::IValue>& args, const Kwargs& kwargs, int64_t n,
                                             const InputSplit& how, bool same_batch) {
  check_num_microbatches(n);
  if (how.fn) {
    MicrobatchInputs out = how.fn(args, kwargs, n);
    const size_t got =
        out.args.size() != static_cast<size_t>(n) ? out.args.size() : out.kwargs.size();
    TORCH_CHECK_VALUE(got == static_cast<size_t>(n), "split_input function returned ", got,
                      " microbatches, expected ", n, " (", out.args.size(), " args lists, ",
                      out.kwargs.size(), " kwargs dicts)");
    return out;
  }
  TORCH_CHECK_VALUE(!how.args_spec || how.args_spec->size() == args.size(), "args_spec has ",
                    how.args_spec ? how.args_spec->size() : 0, " specs but the call has ",
                    args.size(), " positional arguments");
  std::unordered_map<std::string, const Spec*> kwarg_specs;
  if (how.kwargs_spec) {
    for (const auto& [key, spec] : *how.kwargs_spec) {
      TORCH_CHECK_VALUE(kwargs.contains(key), "kwargs_spec names '", key,
                        "', which is not a keyword argument of the call");
      TORCH_CHECK_VALUE(kwarg_specs.emplace(key, &spec).second, "kwargs_spec names '", key,
                        "' twice");
    }
  }

  MicrobatchInputs out;
  out.args.resize(n);
  for (int64_t m = 0; m < n; ++m) {  // distinct dicts: Dict copies share storage
    out.kwargs.push_back(make_kwargs());
  }
  SplitRows rows;
  SplitContext ctx{n, c10::nullopt, same_batch ? &rows : nullptr};
  for (size_t i = 0; i < args.size(); ++i) {
    const Spec& spec = how.args_spec ? (*how.args_spec)[i] : auto_spec();
    Pieces pieces = split_value(args[i], spec, c10::str("args[", i, "]"), ctx);
    for (int64_t m = 0; m < n; ++m) out.args[m].push_back(std::move(pieces[m]));
  }
  ctx.batch_size = find_batch_size(args, kwargs);
  for (const auto& entry : kwargs) {
    auto it = kwarg_specs.find(entry.key());
    const Spec& spec = it == kwarg_specs.end() ? auto_spec() : *it->second;
    Pieces pieces = split_value(entry.value(), spec, c10::str("kwargs['", entry.key(), "']"), ctx);
    for (int64_t m = 0; m < n; ++m) out.kwargs[m].insert(entry.key(), std::move(pieces[m]));
  }
  return out;
}

static std::vector<c10::IValue> split_label_unnamed(const c10::IValue& label, int64_t n, const LabelSplit& how,
                                                    c10::optional<int64_t> batch_size) {
  check_num_microbatches(n);
  if (how.fn) {
    std::vector<c10::IValue> out = how.fn(label, n);
    TORCH_CHECK_VALUE(out.size() == static_cast<size_t>(n), "split_label function returned ",
                      out.size(), " microbatches, expected ", n);
    return out;
  }
  SplitRows rows;
  if (batch_size) rows = SplitRows{batch_size, "the inputs"};
  return split_value(label, how.spec, "label", SplitContext{n, c10::nullopt, batch_size ? &rows : nullptr});
}

static c10::IValue merge_outputs_unnamed(const std::vector<c10::IValue>& outputs, const OutputMerge& how) {
  TORCH_CHECK_VALUE(!outputs.empty(), "no microbatch outputs to merge");
  // merge == false wins over fn and spec: chaining needs the per-microbatch values.
  if (!how.merge) return unmerged(outputs, "output");
  if (how.fn) return how.fn(outputs);
  return merge_value(outputs, how.spec, "output");
}

// The entry points: their errors name them (the messages above say where in
// the value tree the problem is).
template <typename F>
static auto naming(const char* entry, F&& f) {
  try {
    return f();
  } catch (c10::Error& e) {
    e.add_context(std::string("in ") + entry);  // same object, same type
    throw;
  }
}

MicrobatchInputs split_inputs(const std::vector<c10::IValue>& args, const Kwargs& kwargs, int64_t n,
                              const InputSplit& how) {
  return naming("split_inputs", [&] { return split_inputs_unnamed(args, kwargs, n, how, false); });
}

MicrobatchInputs split_batch_inputs(const std::vector<c10::IValue>& args, const Kwargs& kwargs, int64_t n,
                                    const InputSplit& how) {
  return naming("split_inputs", [&] { return split_inputs_unnamed(args, kwargs, n, how, true); });
}

std::vector<c10::IValue> split_label(const c10::IValue& label, int64_t n, const LabelSplit& how,
                                     c10::optional<int64_t> batch_size) {
  return naming("split_label", [&] { return split_label_unnamed(label, n, how, batch_size); });
}

c10::IValue merge_outputs(const std::vector<c10::IValue>& outputs, const OutputMerge& how) {
  return naming("merge_outputs", [&] { return merge_outputs_unnamed(outputs, how); });
}

}  // namespace roundpipe
