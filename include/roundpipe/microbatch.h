// Splitting call inputs into microbatches and merging their outputs.
//
// Values are c10::IValue trees: tuples, lists and string-keyed dicts are
// traversed; tensors and every other value are leaves. A Spec tree mirrors a
// value tree (or a part of it); a default-constructed Spec means "automatic"
// for the whole subtree below it.
//
// Thread-safety: Spec is an immutable value, safe to share between threads.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/custom_class.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace roundpipe {

// Keyword arguments of a call, in insertion order.
using Kwargs = c10::Dict<std::string, c10::IValue>;

// Kwargs holding `items` (later duplicates win). Use this to construct Kwargs:
// c10::Dict<std::string, c10::IValue> has no public constructor.
Kwargs make_kwargs(std::vector<std::pair<std::string, c10::IValue>> items = {});

// One node of a split or merge specification.
class Spec {
 public:
  enum class Kind { kAuto, kChunk, kReplicate, kReducer, kTuple, kList, kDict };
  using ReduceFn = std::function<c10::IValue(const c10::IValue& acc, const c10::IValue& x)>;

  // Automatic handling of the whole subtree: tensors with dims are split along
  // dim 0 (a keyword tensor only if its dim 0 is the batch size) and
  // concatenated; other values are replicated, and on merge floating scalars
  // are averaged and other values must agree across microbatches.
  Spec() = default;

  static Spec tuple(std::vector<Spec> items);
  static Spec list(std::vector<Spec> items);
  static Spec dict(std::vector<std::pair<std::string, Spec>> items);

  Kind kind() const { return kind_; }
  int64_t dim() const { return dim_; }                      // kChunk only
  const c10::IValue& init() const { return init_; }         // kReducer only
  const ReduceFn& reduce_fn() const { return reduce_fn_; }  // kReducer only
  const std::vector<Spec>& items() const { return items_; } // kTuple / kList / kDict
  const std::vector<std::string>& keys() const { return keys_; }  // kDict

 private:
  friend Spec TensorChunkSpec(int64_t dim);
  friend Spec Replicate();
  friend Spec CustomReducer(c10::IValue init, ReduceFn fn);

  Kind kind_ = Kind::kAuto;
  int64_t dim_ = 0;
  c10::IValue init_;
  ReduceFn reduce_fn_;
  std::vector<Spec> items_;
  std::vector<std::string> keys_;
};

// Split a tensor leaf along `dim` (negative counts from the end); merge by
// concatenating along `dim`.
Spec TensorChunkSpec(int64_t dim = 0);
// Give every microbatch the same value; merge by taking microbatch 0's value.
Spec Replicate();
// Merge only: fold the microbatch values into `init` with `fn`, in
// microbatch order.
Spec CustomReducer(c10::IValue init, Spec::ReduceFn fn);

// The split of one call's inputs: n microbatches of (args, kwargs).
struct MicrobatchInputs {
  std::vector<std::vector<c10::IValue>> args;  // [n][num positional args]
  std::vector<Kwargs> kwargs;                  // [n]
};

using InputSplitFn = std::function<MicrobatchInputs(const std::vector<c10::IValue>& args,
                                                    const Kwargs& kwargs, int64_t n)>;
using LabelSplitFn = std::function<std::vector<c10::IValue>(const c10::IValue& label, int64_t n)>;
using OutputMergeFn = std::function<c10::IValue(const std::vector<c10::IValue>& outputs)>;

// How the inputs of a call are split. Default: automatic.
struct InputSplit {
  c10::optional<std::vector<Spec>> args_spec;  // one Spec per positional arg; nullopt = auto
  c10::optional<std::vector<std::pair<std::string, Spec>>> kwargs_spec;  // nullopt = auto
  InputSplitFn fn;  // when set, it replaces the specs
};

// How the label of a call is split. Default: automatic.
struct LabelSplit {
  Spec spec;
  LabelSplitFn fn;  // when set, it replaces the spec
};

// How microbatch outputs are merged. Default: automatic.
struct OutputMerge {
  bool merge = true;  // false: every leaf becomes a MicrobatchValues (chaining)
  Spec spec;
  OutputMergeFn fn;  // when set, it replaces the spec
};

// A leaf that holds one value per microbatch: what an unmerged output
// (`merge_output=false`) holds in place of each leaf. Splitting a value that
// contains one hands microbatch m its m-th item, so the outputs of one model
// feed another without being merged and split again.
struct MicrobatchValues : torch::CustomClassHolder {
  explicit MicrobatchValues(std::vector<c10::IValue> items) : items(std::move(items)) {}
  std::vector<c10::IValue> items;  // [num_microbatch]
};

// Wraps per-microbatch items into an IValue leaf.
c10::IValue make_microbatch_values(std::vector<c10::IValue> items);
// The MicrobatchValues held by `v`, or nullptr when `v` is not one.
c10::intrusive_ptr<MicrobatchValues> as_microbatch_values(const c10::IValue& v);

// The batch size of a call: dim 0 of the first tensor with at least one
// dimension found depth-first in `args` (then in `kwargs` if `args` has none);
// nullopt when there is no such tensor.
c10::optional<int64_t> find_batch_size(const std::vector<c10::IValue>& args, const Kwargs& kwargs);
// The batch size as `how` splits the inputs: the rows of the first tensor it
// splits, along the dim it splits (find_batch_size for automatic splits);
// nullopt for a split function or when nothing is split.
c10::optional<int64_t> split_batch_size(const std::vector<c10::IValue>& args, const Kwargs& kwargs,
                                        const InputSplit& how);

// Splits the inputs of a call into exactly n microbatches.
// Throws c10::ValueError when a spec does not fit the value, a function returns
// a different number of microbatches, a tensor cannot be chunked (too small),
// or two tensors split (positional ones, or any TensorChunkSpec leaf) do not
// have the same number of rows along their split dims.
MicrobatchInputs split_inputs(const std::vector<c10::IValue>& args, const Kwargs& kwargs, int64_t n,
                              const InputSplit& how);

// Splits a label into exactly n microbatch labels. With `batch_size` (the
// inputs', split_batch_size), every tensor split must have that many rows
// (c10::ValueError naming both sizes otherwise).
std::vector<c10::IValue> split_label(const c10::IValue& label, int64_t n, const LabelSplit& how,
                                     c10::optional<int64_t> batch_size = c10::nullopt);

// Merges n microbatch outputs into one value. Throws c10::ValueError
// when non-tensor leaves differ across microbatches or structures differ.
c10::IValue merge_outputs(const std::vector<c10::IValue>& outputs, const OutputMerge& how);

}  // namespace roundpipe
