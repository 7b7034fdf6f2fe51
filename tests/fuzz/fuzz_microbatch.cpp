// Fuzz target: splitting into microbatches and merging back
// (include/roundpipe/microbatch.h). Random value trees (nested tuples, lists
// and string-keyed dicts of small tensors and other values) are split with a
// random number of microbatches and a spec tree that fits them, or now and
// then one that does not. A split that succeeds with a fitting spec must merge
// back (with the matching merge spec) to the original value, and an unmerged
// output (MicrobatchValues leaves) must split back into the same microbatches.
// Everything else (bad specs, bad counts, random outputs to merge) must return
// or throw c10::Error: never crash or hit undefined behaviour.
#include <fuzzer/FuzzedDataProvider.h>

#include <roundpipe/microbatch.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace {

using c10::IValue;
using roundpipe::Spec;

constexpr int kMaxDepth = 3;

// A value with the spec to split it by, and whether that spec fits (a fitting
// spec must not make the split fail, except for too few rows).
struct Node {
  IValue value;
  Spec split;
  Spec merge;  // what merges the microbatches back into `value`
  bool fits = true;
};

at::Tensor SomeTensor(FuzzedDataProvider& in) {
  std::vector<int64_t> shape(in.ConsumeIntegralInRange<int>(0, 3));
  for (auto& s : shape) s = in.ConsumeIntegralInRange<int64_t>(0, 5);
  const at::ScalarType dtypes[] = {at::kFloat, at::kLong, at::kBool, at::kDouble};
  at::Tensor t = at::empty(shape, at::kLong);
  auto* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = in.ConsumeIntegralInRange<int64_t>(-8, 8);
  return t.to(dtypes[in.ConsumeIntegralInRange<int>(0, 3)]);
}

IValue SomeOtherLeaf(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 6)) {
    case 0: return IValue();
    case 1: return IValue(in.ConsumeIntegral<int64_t>());
    case 2: return IValue(static_cast<double>(in.ConsumeIntegralInRange<int>(-100, 100)) / 4);
    case 3: return IValue(in.ConsumeBool());
    case 4: return IValue(in.ConsumeRandomLengthString(8));
    case 5: return IValue(at::Tensor());  // an undefined tensor
    default: {  // a dict that is not string-keyed: a leaf
      c10::Dict<int64_t, int64_t> d;
      d.insert(in.ConsumeIntegralInRange<int64_t>(0, 3), in.ConsumeIntegral<int64_t>());
      return IValue(d);
    }
  }
}

// A spec that does not fit, or only by chance.
Spec SomeWrongSpec(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 0: return roundpipe::TensorChunkSpec(in.ConsumeIntegral<int64_t>());
    case 1: return Spec::tuple({});
    case 2: return Spec::list({Spec(), Spec()});
    case 3: return Spec::dict({{"a", Spec()}});
    case 4: return roundpipe::CustomReducer(IValue(0), [](const IValue& a, const IValue&) { return a; });
    default: return roundpipe::Replicate();
  }
}

Node SomeNode(FuzzedDataProvider& in, int depth);

// A container of children; its spec either automatic or spelled out.
Node SomeContainer(FuzzedDataProvider& in, int depth) {
  const int kind = in.ConsumeIntegralInRange<int>(0, 2);
  const size_t size = in.ConsumeIntegralInRange<size_t>(0, 4);
  std::vector<Node> kids;
  std::vector<std::string> keys;
  for (size_t i = 0; i < size; ++i) {
    kids.push_back(SomeNode(in, depth + 1));
    // No NUL in keys: c10::Error messages (which quote keys) are C strings,
    // and the check of a failed split below reads them.
    std::string key = std::to_string(i) + in.ConsumeRandomLengthString(3);
    std::replace(key.begin(), key.end(), '\0', '_');
    keys.push_back(key);
  }
  Node n;
  std::vector<IValue> values;
  std::vector<Spec> splits, merges;
  for (auto& k : kids) {
    values.push_back(k.value);
    splits.push_back(k.split);
    merges.push_back(k.merge);
    n.fits = n.fits && k.fits;
  }
  const bool spelled_out = in.ConsumeBool();
  if (kind == 0) {
    n.value = c10::ivalue::Tuple::create(values);
    if (spelled_out) n.split = Spec::tuple(splits), n.merge = Spec::tuple(merges);
  } else if (kind == 1) {
    c10::impl::GenericList list(c10::AnyType::get());
    for (auto& v : values) list.push_back(v);
    n.value = list;
    if (spelled_out) n.split = Spec::list(splits), n.merge = Spec::list(merges);
  } else {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    std::vector<std::pair<std::string, Spec>> split_items, merge_items;
    for (size_t i = 0; i < size; ++i) {
      if (!dict.insert(keys[i], values[i]).second) continue;  // keys made unique by the index
      split_items.emplace_back(keys[i], splits[i]);
      merge_items.emplace_back(keys[i], merges[i]);
    }
    n.value = dict;
    // Spec keys in another order: matched by key, not by position.
    if (in.ConsumeBool()) std::reverse(split_items.begin(), split_items.end());
    if (spelled_out) n.split = Spec::dict(split_items), n.merge = Spec::dict(merge_items);
  }
  // An automatic spec covers the subtree: the children's specs no longer apply.
  if (!spelled_out) {
    n.split = n.merge = Spec();
    n.fits = true;
  }
  return n;
}

Node SomeNode(FuzzedDataProvider& in, int depth) {
  Node n;
  const int what = in.ConsumeIntegralInRange<int>(0, depth < kMaxDepth ? 9 : 5);
  if (what >= 6) {
    n = SomeContainer(in, depth);
  } else if (what >= 3) {
    at::Tensor t = SomeTensor(in);
    n.value = t;
    switch (in.ConsumeIntegralInRange<int>(0, 2)) {
      case 0: break;  // automatic
      case 1: n.split = n.merge = roundpipe::Replicate(); break;
      default:
        if (t.dim() == 0) break;
        // In range, counted from either end.
        const int64_t d = in.ConsumeIntegralInRange<int64_t>(0, t.dim() - 1);
        n.split = n.merge = roundpipe::TensorChunkSpec(in.ConsumeBool() ? d : d - t.dim());
    }
  } else {
    n.value = SomeOtherLeaf(in);
    if (in.ConsumeBool()) n.split = n.merge = roundpipe::Replicate();
  }
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) {
    n.split = SomeWrongSpec(in);
    n.fits = false;
  }
  return n;
}

bool Same(const IValue& a, const IValue& b) {
  if (a.isTuple() || a.isList()) {
    if (a.isTuple() != b.isTuple() || a.isList() != b.isList()) return false;
    const auto xs = a.isTuple() ? a.toTupleRef().elements().vec() : a.toListRef().vec();
    const auto ys = b.isTuple() ? b.toTupleRef().elements().vec() : b.toListRef().vec();
    if (xs.size() != ys.size()) return false;
    for (size_t i = 0; i < xs.size(); ++i) {
      if (!Same(xs[i], ys[i])) return false;
    }
    return true;
  }
  if (a.isTensor()) {
    if (!b.isTensor()) return false;
    const at::Tensor& x = a.toTensor();
    const at::Tensor& y = b.toTensor();
    if (!x.defined() || !y.defined()) return x.defined() == y.defined();
    if (x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes()) return false;
    // Floating scalars are averaged over the microbatches: equal up to rounding.
    if (x.dim() == 0 && x.is_floating_point()) return at::allclose(x, y);
    return at::equal(x, y);
  }
  if (auto mv = roundpipe::as_microbatch_values(a)) return a.isSameIdentity(b);
  if (a.isGenericDict() && b.isGenericDict()) {
    const auto x = a.toGenericDict();
    const auto y = b.toGenericDict();
    if (x.size() != y.size()) return false;
    auto i = x.begin();
    auto j = y.begin();
    for (; i != x.end(); ++i, ++j) {
      if (i->key() != j->key() || !Same(i->value(), j->value())) return false;
    }
    return true;
  }
  return a == b;
}

// Keys may hold any byte: print whole strings, not up to the first NUL.
void Fail(const std::string& what, const IValue& v) {
  const std::string msg = c10::str(what, "; value: ", v, "\n");
  std::fwrite(msg.data(), 1, msg.size(), stderr);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  int64_t n = in.ConsumeIntegralInRange<int64_t>(1, 6);
  if (in.ConsumeIntegralInRange<int>(0, 31) == 0) {  // a bad count now and then
    const int64_t bad[] = {0, -1, std::numeric_limits<int64_t>::min()};
    n = bad[in.ConsumeIntegralInRange<int>(0, 2)];
  }
  const Node node = SomeNode(in, 0);

  // Split and merge back.
  std::vector<IValue> pieces;
  try {
    pieces = roundpipe::split_label(node.value, n, roundpipe::LabelSplit{node.split, {}});
  } catch (const c10::Error& e) {
    // A fitting spec fails only on a bad count or a tensor with too few rows.
    const std::string msg = e.what_without_backtrace();
    if (node.fits && n >= 1 && msg.find("microbatches (fewer than") == std::string::npos) {
      Fail("a fitting spec did not split: " + msg, node.value);
    }
    pieces.clear();
  }
  if (!pieces.empty()) {
    if (static_cast<int64_t>(pieces.size()) != n) Fail("wrong number of microbatches", node.value);
    if (node.fits) {
      const IValue merged = roundpipe::merge_outputs(pieces, roundpipe::OutputMerge{true, node.merge, {}});
      if (!Same(merged, node.value)) Fail("merge(split(x)) != x", node.value);
      // Unmerged (chained) outputs split back into the same microbatches.
      const IValue chained = roundpipe::merge_outputs(pieces, roundpipe::OutputMerge{false, {}, {}});
      const auto again = roundpipe::split_label(chained, n, {});
      for (int64_t m = 0; m < n; ++m) {
        if (!Same(again[m], pieces[m])) Fail("split(unmerged(pieces)) != pieces", node.value);
      }
    }
  }

  // The same value as positional and keyword arguments of a call, then a
  // merge of unrelated values: c10::Error or a result, nothing else.
  try {
    roundpipe::InputSplit how;
    if (in.ConsumeBool()) how.args_spec = std::vector<Spec>{node.split};
    auto kwargs = roundpipe::make_kwargs({{"x", SomeNode(in, 1).value}, {"y", node.value}});
    (void)roundpipe::split_inputs({node.value}, kwargs, n, how);
  } catch (const c10::Error&) {
  }
  try {
    std::vector<IValue> outputs(in.ConsumeIntegralInRange<size_t>(0, 4));
    for (auto& o : outputs) o = in.ConsumeBool() ? node.value : SomeNode(in, 1).value;
    const Spec spec = in.ConsumeBool() ? node.merge : SomeNode(in, 0).split;
    (void)roundpipe::merge_outputs(outputs, roundpipe::OutputMerge{in.ConsumeBool(), spec, {}});
  } catch (const c10::Error&) {
  }
  return 0;
}
