// Tests for splitting inputs into microbatches and merging outputs (roundpipe/microbatch.h).
#include <roundpipe/microbatch.h>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace roundpipe {
namespace {

using c10::IValue;
using ::testing::HasSubstr;

// --- Value builders --------------------------------------------------------

IValue Tup(std::vector<IValue> items) { return c10::ivalue::Tuple::create(std::move(items)); }

IValue List(std::vector<IValue> items) {
  c10::impl::GenericList list(c10::AnyType::get());
  for (auto& item : items) list.push_back(std::move(item));
  return list;
}

IValue Dict(std::vector<std::pair<std::string, IValue>> items) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  for (auto& [key, value] : items) dict.insert(key, std::move(value));
  return dict;
}

Kwargs Kw(std::vector<std::pair<std::string, IValue>> items) {
  return c10::impl::toTypedDict<std::string, IValue>(Dict(std::move(items)).toGenericDict());
}

// A float tensor [rows, cols] holding 0, 1, 2, ... row-major.
at::Tensor Range(int64_t rows, int64_t cols = 2) {
  return at::arange(rows * cols, at::kFloat).reshape({rows, cols});
}

// The message of the c10::ValueError `f` throws, or a marker when it throws
// something else or nothing.
template <class F>
std::string ValueErrorOf(F&& f) {
  try {
    f();
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return std::string("<not a ValueError> ") + e.what();
  }
  return "<no exception>";
}

std::vector<int64_t> Rows(const std::vector<IValue>& pieces) {
  std::vector<int64_t> rows;
  for (const auto& p : pieces) rows.push_back(p.toTensor().size(0));
  return rows;
}

std::vector<IValue> Arg(const MicrobatchInputs& in, size_t i) {
  std::vector<IValue> out;
  for (const auto& args : in.args) out.push_back(args.at(i));
  return out;
}

// --- find_batch_size -------------------------------------------------------

TEST(FindBatchSizeTest, FirstTensorWithDimsDepthFirst) {
  EXPECT_EQ(find_batch_size({IValue(3), Tup({at::scalar_tensor(1.0), List({Range(5), Range(2)})})},
                            Kw({{"x", Range(9)}})),
            5);
  EXPECT_EQ(find_batch_size({IValue("s")}, Kw({{"a", IValue(1)}, {"b", Range(4)}})), 4);
  EXPECT_FALSE(find_batch_size({at::scalar_tensor(2.0)}, Kw({{"a", IValue(1)}})).has_value());
  EXPECT_FALSE(find_batch_size({make_microbatch_values({Range(2), Range(2)})}, Kw({})).has_value());
}

// --- Automatic split -------------------------------------------------------

TEST(SplitAutoTest, UnevenSplitUsesTensorSplitSizes) {
  const at::Tensor x = Range(7);
  const auto in = split_inputs({x}, Kw({}), 3, {});
  ASSERT_EQ(in.args.size(), 3u);
  ASSERT_EQ(in.kwargs.size(), 3u);
  const auto pieces = Arg(in, 0);
  EXPECT_EQ(Rows(pieces), (std::vector<int64_t>{3, 2, 2}));
  EXPECT_TRUE(at::equal(pieces[1].toTensor(), x.slice(0, 3, 5)));
  EXPECT_TRUE(
      at::equal(at::cat({pieces[0].toTensor(), pieces[1].toTensor(), pieces[2].toTensor()}), x));
  // Views of the caller's tensor, not copies.
  EXPECT_TRUE(pieces[2].toTensor().is_view());
  EXPECT_EQ(pieces[2].toTensor().data_ptr<float>(), x.data_ptr<float>() + 5 * 2);
}

TEST(SplitAutoTest, NestedStructuresKeepTheirTypes) {
  const at::Tensor a = Range(4), b = Range(4, 3), c = Range(4, 1);
  const IValue arg = Tup({a, List({b, IValue(5)}), Dict({{"z", c}, {"a", IValue("tag")}})});
  const auto in = split_inputs({arg}, Kw({}), 2, {});
  for (int m = 0; m < 2; ++m) {
    const IValue& v = in.args[m][0];
    ASSERT_TRUE(v.isTuple());
    const auto& t = v.toTupleRef().elements();
    ASSERT_EQ(t.size(), 3u);
    EXPECT_TRUE(at::equal(t[0].toTensor(), a.slice(0, 2 * m, 2 * m + 2)));
    ASSERT_TRUE(t[1].isList());
    const auto list = t[1].toList();
    ASSERT_EQ(list.size(), 2u);
    EXPECT_TRUE(at::equal(list.get(0).toTensor(), b.slice(0, 2 * m, 2 * m + 2)));
    EXPECT_EQ(list.get(1).toInt(), 5);
    ASSERT_TRUE(t[2].isGenericDict());
    const auto dict = t[2].toGenericDict();
    std::vector<std::string> keys;
    for (const auto& e : dict) keys.push_back(e.key().toStringRef());
    EXPECT_EQ(keys, (std::vector<std::string>{"z", "a"}));  // insertion order kept
    EXPECT_TRUE(at::equal(dict.at("z").toTensor(), c.slice(0, 2 * m, 2 * m + 2)));
    EXPECT_EQ(dict.at("a").toStringRef(), "tag");
  }
}

TEST(SplitAutoTest, TypedTensorListStaysTyped) {
  const IValue arg(c10::List<at::Tensor>({Range(6), Range(6, 4)}));
  ASSERT_TRUE(arg.isTensorList());
  const auto in = split_inputs({arg}, Kw({}), 3, {});
  for (const auto& args : in.args) {
    ASSERT_TRUE(args[0].isTensorList());
    EXPECT_EQ(args[0].toTensorList().get(1).sizes(), (std::vector<int64_t>{2, 4}));
  }
}

TEST(SplitAutoTest, ScalarTensorsAndNonTensorsAreReplicated) {
  const at::Tensor scalar = at::scalar_tensor(3.5);
  const auto in = split_inputs({scalar, IValue(2.5), IValue("s"), IValue()}, Kw({}), 4, {});
  for (const auto& args : in.args) {
    ASSERT_EQ(args.size(), 4u);
    EXPECT_TRUE(args[0].toTensor().is_same(scalar));
    EXPECT_EQ(args[1].toDouble(), 2.5);
    EXPECT_EQ(args[2].toStringRef(), "s");
    EXPECT_TRUE(args[3].isNone());
  }
}

TEST(SplitAutoTest, KwargsWithOtherDim0AreReplicated) {
  const at::Tensor x = Range(6), mask = Range(6, 3), bias = Range(4), nested = Range(3);
  const auto in =
      split_inputs({x}, Kw({{"mask", mask}, {"bias", bias}, {"pair", Tup({nested, mask})}}), 3, {});
  for (int m = 0; m < 3; ++m) {
    const Kwargs& kw = in.kwargs[m];
    EXPECT_TRUE(at::equal(kw.at("mask").toTensor(), mask.slice(0, 2 * m, 2 * m + 2)));
    EXPECT_TRUE(kw.at("bias").toTensor().is_same(bias));
    const auto& pair = kw.at("pair").toTupleRef().elements();
    EXPECT_TRUE(pair[0].toTensor().is_same(nested));
    EXPECT_EQ(pair[1].toTensor().size(0), 2);
  }
  // Positional args are always split, whatever their dim 0.
  const auto in2 = split_inputs({x, bias}, Kw({}), 3, {});
  EXPECT_EQ(Rows(Arg(in2, 1)), (std::vector<int64_t>{2, 1, 1}));
}

TEST(SplitAutoTest, KwargsOnlyCallTakesBatchSizeFromFirstKwarg) {
  const auto in = split_inputs({}, Kw({{"ids", Range(4)}, {"table", Range(9)}}), 2, {});
  EXPECT_EQ(in.kwargs[0].at("ids").toTensor().size(0), 2);
  EXPECT_EQ(in.kwargs[0].at("table").toTensor().size(0), 9);
}

TEST(SplitAutoTest, TooFewRowsIsAValueError) {
  const auto msg = ValueErrorOf([] { split_inputs({IValue(1), Range(2)}, Kw({}), 3, {}); });
  EXPECT_THAT(msg, HasSubstr("args[1]"));
  EXPECT_THAT(msg, HasSubstr("fewer than 3 rows"));
  EXPECT_THAT(ValueErrorOf([] { split_inputs({Range(2)}, Kw({}), 0, {}); }),
              HasSubstr("at least 1"));
}

TEST(SplitAutoTest, MicrobatchValuesHandOutTheirItems) {
  const IValue mv = make_microbatch_values({IValue(10), IValue(11), IValue(12)});
  ASSERT_TRUE(as_microbatch_values(mv));
  EXPECT_FALSE(as_microbatch_values(IValue(1)));
  EXPECT_FALSE(as_microbatch_values(Range(2)));
  const auto in = split_inputs({Tup({mv})}, Kw({{"k", mv}}), 3, {});
  for (int m = 0; m < 3; ++m) {
    EXPECT_EQ(in.args[m][0].toTupleRef().elements()[0].toInt(), 10 + m);
    EXPECT_EQ(in.kwargs[m].at("k").toInt(), 10 + m);
  }
  const auto msg = ValueErrorOf([&] { split_inputs({Tup({mv})}, Kw({}), 2, {}); });
  EXPECT_THAT(msg, HasSubstr("args[0][0]"));
  EXPECT_THAT(msg, HasSubstr("3 items, expected 2"));
}

// --- Spec split ------------------------------------------------------------

TEST(SplitSpecTest, ChunkAlongOtherDimsAndReplicate) {
  const at::Tensor x = Range(2, 6), w = Range(5);
  InputSplit how;
  how.args_spec = std::vector<Spec>{TensorChunkSpec(1), Replicate(),
                                    Spec::tuple({TensorChunkSpec(-1), Spec()})};
  const auto in = split_inputs({x, w, Tup({x, w})}, Kw({}), 3, how);
  for (int m = 0; m < 3; ++m) {
    EXPECT_TRUE(at::equal(in.args[m][0].toTensor(), x.slice(1, 2 * m, 2 * m + 2)));
    EXPECT_TRUE(in.args[m][1].toTensor().is_same(w));
    const auto& t = in.args[m][2].toTupleRef().elements();
    EXPECT_TRUE(at::equal(t[0].toTensor(), x.slice(1, 2 * m, 2 * m + 2)));
    EXPECT_EQ(t[1].toTensor().size(0), m == 2 ? 1 : 2);  // Spec() is automatic: 5 rows -> 2,2,1
  }
}

TEST(SplitSpecTest, KwargsSpecOverridesOnlyNamedKeys) {
  const at::Tensor x = Range(4), mask = Range(4);
  InputSplit how;
  how.kwargs_spec = std::vector<std::pair<std::string, Spec>>{{"mask", Replicate()}};
  const auto in = split_inputs({}, Kw({{"x", x}, {"mask", mask}}), 2, how);
  EXPECT_EQ(in.kwargs[1].at("x").toTensor().size(0), 2);
  EXPECT_TRUE(in.kwargs[1].at("mask").toTensor().is_same(mask));
  std::vector<std::string> keys;
  for (const auto& e : in.kwargs[1]) keys.push_back(e.key());
  EXPECT_EQ(keys, (std::vector<std::string>{"x", "mask"}));
}

TEST(SplitSpecTest, MismatchesNameThePath) {
  const std::vector<IValue> args{Range(4), Tup({IValue(1), Range(4)})};
  auto split = [&](std::vector<Spec> args_spec,
                   std::vector<std::pair<std::string, Spec>> kwargs_spec = {}) {
    InputSplit how;
    how.args_spec = std::move(args_spec);
    how.kwargs_spec = std::move(kwargs_spec);
    split_inputs(args, Kw({{"mask", Dict({{"a", Range(4)}})}}), 2, how);
  };
  auto msg = ValueErrorOf([&] { split({Spec(), Spec::tuple({TensorChunkSpec(0), Spec()})}); });
  EXPECT_THAT(msg, HasSubstr("args[1][0]"));
  EXPECT_THAT(msg, HasSubstr("needs a tensor"));
  msg = ValueErrorOf([&] { split({TensorChunkSpec(2), Spec()}); });
  EXPECT_THAT(msg, HasSubstr("args[0]"));
  EXPECT_THAT(msg, HasSubstr("out of range"));
  msg = ValueErrorOf([&] { split({Spec(), Spec::tuple({Spec()})}); });
  EXPECT_THAT(msg, HasSubstr("args[1]: spec expects a tuple of 1 items, got a tuple of 2"));
  msg = ValueErrorOf([&] { split({Spec(), Spec::list({Spec(), Spec()})}); });
  EXPECT_THAT(msg, HasSubstr("spec expects a list"));
  msg = ValueErrorOf([&] { split({Spec(), Spec()}, {{"mask", Spec::dict({{"b", Spec()}})}}); });
  EXPECT_THAT(msg, HasSubstr("kwargs['mask']"));
  msg = ValueErrorOf([&] { split({Spec()}); });
  EXPECT_THAT(msg, HasSubstr("args_spec has 1 specs but the call has 2"));
  msg = ValueErrorOf([&] { split({Spec(), Spec()}, {{"nope", Replicate()}}); });
  EXPECT_THAT(msg, HasSubstr("'nope'"));
  msg = ValueErrorOf([&] { split({CustomReducer(IValue(0), nullptr), Spec()}); });
  EXPECT_THAT(msg, HasSubstr("reduce function is empty"));
  auto add = [](const IValue& a, const IValue& b) { return a; };
  msg = ValueErrorOf([&] { split({CustomReducer(IValue(0), add), Spec()}); });
  EXPECT_THAT(msg, HasSubstr("args[0]: CustomReducer is for merging"));
}

TEST(SplitSpecTest, FunctionReplacesSpecsAndIsCounted) {
  InputSplit how;
  how.args_spec = std::vector<Spec>{Replicate()};  // ignored: fn wins
  how.fn = [](const std::vector<IValue>& args, const Kwargs& kwargs, int64_t n) {
    MicrobatchInputs out;
    for (int64_t m = 0; m < n; ++m) {
      out.args.push_back({IValue(m)});
      out.kwargs.push_back(kwargs);
    }
    return out;
  };
  const auto in = split_inputs({Range(3)}, Kw({}), 3, how);
  ASSERT_EQ(in.args.size(), 3u);
  EXPECT_EQ(in.args[2][0].toInt(), 2);

  how.fn = [](const std::vector<IValue>& args, const Kwargs& kwargs, int64_t n) {
    return MicrobatchInputs{{args, args}, {kwargs, kwargs}};
  };
  EXPECT_THAT(ValueErrorOf([&] { split_inputs({Range(3)}, Kw({}), 3, how); }),
              HasSubstr("split_input function returned 2 microbatches, expected 3"));
  how.fn = [](const std::vector<IValue>& args, const Kwargs& kwargs, int64_t n) {
    return MicrobatchInputs{{args, args, args}, {kwargs}};
  };
  EXPECT_THAT(ValueErrorOf([&] { split_inputs({Range(3)}, Kw({}), 3, how); }),
              HasSubstr("split_input function returned 1 microbatches, expected 3"));
}

TEST(SplitLabelTest, AutoSpecAndFunction) {
  const at::Tensor y = Range(5, 4);
  EXPECT_EQ(Rows(split_label(y, 2, {})), (std::vector<int64_t>{3, 2}));
  const auto by_col = split_label(y, 2, {TensorChunkSpec(1), nullptr});
  EXPECT_EQ(by_col[1].toTensor().sizes(), (std::vector<int64_t>{5, 2}));
  EXPECT_THAT(ValueErrorOf([&] {
                split_label(IValue(7), 2, {TensorChunkSpec(0), nullptr});
              }),
              HasSubstr("label: TensorChunkSpec(0) needs a tensor"));

  LabelSplit how;
  how.fn = [](const IValue& label, int64_t n) { return std::vector<IValue>(n, label); };
  EXPECT_EQ(split_label(IValue(7), 4, how).size(), 4u);
  how.fn = [](const IValue& label, int64_t n) { return std::vector<IValue>{label}; };
  EXPECT_THAT(ValueErrorOf([&] { split_label(IValue(7), 4, how); }),
              HasSubstr("split_label function returned 1 microbatches, expected 4"));
}

// --- Autograd --------------------------------------------------------------

TEST(SplitAutogradTest, GradientsReachTheOriginalTensor) {
  const at::Tensor x = Range(6).requires_grad_(true);
  const auto pieces = split_label(Tup({x}), 3, {});
  at::Tensor loss = at::zeros({}, at::kFloat);
  for (int m = 0; m < 3; ++m) {
    const at::Tensor chunk = pieces[m].toTupleRef().elements()[0].toTensor();
    EXPECT_TRUE(chunk.requires_grad());
    loss = loss + (m + 1) * chunk.sum();
  }
  loss.backward();
  const at::Tensor expected =
      at::tensor({1.f, 1.f, 2.f, 2.f, 3.f, 3.f}).unsqueeze(1).expand({6, 2});
  EXPECT_TRUE(at::equal(x.grad(), expected));
}

TEST(SplitAutogradTest, MergeKeepsTheGraph) {
  const at::Tensor x = Range(4, 3).requires_grad_(true);
  InputSplit how;
  how.args_spec = std::vector<Spec>{TensorChunkSpec(1)};
  const auto in = split_inputs({x}, Kw({}), 3, how);
  std::vector<IValue> outs;
  for (int m = 0; m < 3; ++m) outs.emplace_back(in.args[m][0].toTensor() * (m + 1));
  OutputMerge merge;
  merge.spec = TensorChunkSpec(1);
  merge_outputs(outs, merge).toTensor().sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), at::tensor({1.f, 2.f, 3.f}).expand({4, 3})));
}

// --- Merge -----------------------------------------------------------------

TEST(MergeTest, AutomaticMergeConcatenatesAndAverages) {
  const at::Tensor x = Range(7);
  const auto pieces = split_label(x, 3, {});
  std::vector<IValue> outs;
  for (int m = 0; m < 3; ++m) {
    outs.push_back(Tup({pieces[m], at::scalar_tensor(m), at::scalar_tensor(4, at::kLong),
                        IValue("cfg"), Dict({{"h", pieces[m]}, {"n", IValue(2)}})}));
  }
  const IValue merged = merge_outputs(outs, {});
  ASSERT_TRUE(merged.isTuple());
  const auto& t = merged.toTupleRef().elements();
  EXPECT_TRUE(at::equal(t[0].toTensor(), x));
  EXPECT_EQ(t[1].toTensor().dim(), 0);
  EXPECT_EQ(t[1].toTensor().scalar_type(), at::kFloat);
  EXPECT_FLOAT_EQ(t[1].toTensor().item<float>(), 1.0f);
  EXPECT_EQ(t[2].toTensor().item<int64_t>(), 4);
  EXPECT_EQ(t[3].toStringRef(), "cfg");
  const auto dict = t[4].toGenericDict();
  EXPECT_TRUE(at::equal(dict.at("h").toTensor(), x));
  EXPECT_EQ(dict.at("n").toInt(), 2);
}

TEST(MergeTest, DifferingNonTensorLeavesAreAValueError) {
  auto msg = ValueErrorOf([] {
    merge_outputs(
        {Tup({Range(1), IValue(1)}), Tup({Range(1), IValue(1)}), Tup({Range(1), IValue(2)})}, {});
  });
  EXPECT_THAT(msg, HasSubstr("output[1]"));
  EXPECT_THAT(msg, HasSubstr("microbatch 0 and microbatch 2"));
  msg = ValueErrorOf([] {
    merge_outputs({at::scalar_tensor(1, at::kLong), at::scalar_tensor(2, at::kLong)}, {});
  });
  EXPECT_THAT(msg, HasSubstr("microbatch 0 and microbatch 1"));
  msg = ValueErrorOf([] { merge_outputs({Range(2), IValue(3)}, {}); });
  EXPECT_THAT(msg, HasSubstr("microbatch 1 is a value of kind Int"));
  EXPECT_THAT(ValueErrorOf([] { merge_outputs({}, {}); }), HasSubstr("no microbatch outputs"));
}

TEST(MergeTest, StructureMismatchIsAValueError) {
  auto msg = ValueErrorOf([] {
    merge_outputs({List({Tup({Range(1)})}), List({Tup({Range(1), Range(1)})})}, {});
  });
  EXPECT_THAT(msg, HasSubstr("output[0]: microbatch 0 is a tuple of 1 items"));
  msg = ValueErrorOf([] { merge_outputs({Tup({Range(1)}), List({Range(1)})}, {}); });
  EXPECT_THAT(msg, HasSubstr("but microbatch 1 is a list"));
  msg = ValueErrorOf([] { merge_outputs({Dict({{"a", Range(1)}}), Dict({{"b", Range(1)}})}, {}); });
  EXPECT_THAT(msg, HasSubstr("key 'a' is in microbatch 0 but not in microbatch 1"));
  msg = ValueErrorOf([] { merge_outputs({Range(2, 3), Range(2, 4)}, {}); });
  EXPECT_THAT(msg, HasSubstr("cannot concatenate"));
}

TEST(MergeTest, SpecMergeChunkReplicateReducer) {
  const auto sum = [](const IValue& acc, const IValue& x) {
    return IValue(acc.toInt() + x.toInt());
  };
  OutputMerge how;
  how.spec = Spec::dict({{"loss", CustomReducer(IValue(100), sum)},
                         {"h", TensorChunkSpec(-1)},
                         {"cfg", Replicate()}});
  std::vector<IValue> outs;
  for (int m = 0; m < 3; ++m) {
    outs.push_back(Dict({{"h", Range(2, m + 1)}, {"cfg", IValue(m)}, {"loss", IValue(m + 1)}}));
  }
  const auto merged = merge_outputs(outs, how).toGenericDict();
  std::vector<std::string> keys;
  for (const auto& e : merged) keys.push_back(e.key().toStringRef());
  EXPECT_EQ(keys, (std::vector<std::string>{"h", "cfg", "loss"}));  // microbatch 0's order
  EXPECT_EQ(merged.at("h").toTensor().sizes(), (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(merged.at("cfg").toInt(), 0);
  EXPECT_EQ(merged.at("loss").toInt(), 106);

  // Order of the fold is microbatch order.
  how.spec = CustomReducer(IValue(std::string()), [](const IValue& acc, const IValue& x) {
    return IValue(acc.toStringRef() + x.toStringRef());
  });
  EXPECT_EQ(merge_outputs({IValue("a"), IValue("b"), IValue("c")}, how).toStringRef(), "abc");

  how.spec = Spec::tuple({Spec(), Spec()});
  EXPECT_THAT(ValueErrorOf([&] {
                merge_outputs({Tup({Range(1), Range(1)}), Tup({Range(1)})}, how);
              }),
              HasSubstr("output (microbatch 1): spec expects a tuple of 2 items"));
}

TEST(MergeTest, FunctionReplacesSpec) {
  OutputMerge how;
  how.spec = Replicate();
  how.fn = [](const std::vector<IValue>& outs) { return IValue(int64_t(outs.size())); };
  EXPECT_EQ(merge_outputs({IValue(1), IValue(2)}, how).toInt(), 2);
}

TEST(MergeTest, SingleMicrobatchIsEquivalent) {
  const at::Tensor x = Range(3);
  const IValue merged = merge_outputs({Tup({x, at::scalar_tensor(2.0), IValue(4)})}, {});
  const auto& t = merged.toTupleRef().elements();
  EXPECT_TRUE(at::equal(t[0].toTensor(), x));
  EXPECT_EQ(t[1].toTensor().item<double>(), 2.0);
  EXPECT_EQ(t[2].toInt(), 4);
}

TEST(MergeTest, UnmergedOutputsHoldMicrobatchValues) {
  OutputMerge how;
  how.merge = false;
  how.fn = [](const std::vector<IValue>&) -> IValue { throw std::runtime_error("not called"); };
  const IValue out = merge_outputs(
      {Tup({IValue(1), Dict({{"h", Range(1)}})}), Tup({IValue(2), Dict({{"h", Range(2)}})})}, how);
  ASSERT_TRUE(out.isTuple());
  const auto& t = out.toTupleRef().elements();
  const auto first = as_microbatch_values(t[0]);
  ASSERT_TRUE(first);
  EXPECT_EQ(first->items.size(), 2u);
  EXPECT_EQ(first->items[1].toInt(), 2);
  const auto h = as_microbatch_values(t[1].toGenericDict().at("h"));
  ASSERT_TRUE(h);
  EXPECT_EQ(h->items[1].toTensor().size(0), 2);
  EXPECT_THAT(ValueErrorOf([&] {
                merge_outputs({Tup({IValue(1)}), List({IValue(1)})}, how);
              }),
              HasSubstr("microbatch 0 is a tuple"));
}

TEST(MergeTest, UnmergedOutputRoundTripsThroughSplit) {
  const at::Tensor x = Range(7);
  const auto in = split_inputs({x}, Kw({}), 3, {});
  std::vector<IValue> outs;  // a "model": (2x, {"h": x})
  for (const auto& args : in.args) {
    const at::Tensor piece = args[0].toTensor();
    outs.push_back(Tup({piece * 2, Dict({{"h", piece}})}));
  }
  OutputMerge how;
  how.merge = false;
  const IValue chained = merge_outputs(outs, how);
  const auto in2 = split_inputs({chained}, Kw({{"again", chained}}), 3, {});
  for (int m = 0; m < 3; ++m) {
    for (const IValue& v : {in2.args[m][0], in2.kwargs[m].at("again")}) {
      const auto& t = v.toTupleRef().elements();
      const auto& expected = outs[m].toTupleRef().elements();
      EXPECT_TRUE(t[0].toTensor().is_same(expected[0].toTensor()));
      EXPECT_TRUE(t[1].toGenericDict().at("h").toTensor().is_same(
          expected[1].toGenericDict().at("h").toTensor()));
    }
  }
  // The unmerged values merge like the originals.
  EXPECT_TRUE(
      at::equal(merge_outputs(Arg(in2, 0), {}).toTupleRef().elements()[0].toTensor(), x * 2));
}

}  // namespace
}  // namespace roundpipe
