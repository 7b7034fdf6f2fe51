// Tests for execution plan validation, to_string and default_plan (roundpipe/plan.h).
#include <roundpipe/plan.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace roundpipe {
namespace {

using Ranges = std::vector<LayerRange>;

ModelExecutePlan Plan(Ranges fwd, Ranges bwd) {
  ModelExecutePlan p;
  p.fwd_plan = std::move(fwd);
  p.bwd_plan = std::move(bwd);
  return p;
}

// The ValueError message of validate(), or "" when the plan is accepted.
std::string ValidateError(const ModelExecutePlan& p, int64_t num_layers, RunKind kind) {
  try {
    p.validate(num_layers, kind);
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// Expects validate() to throw a ValueError whose message holds every fragment.
void ExpectRejected(const ModelExecutePlan& p, int64_t num_layers, RunKind kind,
                    const std::vector<std::string>& fragments) {
  const std::string msg = ValidateError(p, num_layers, kind);
  ASSERT_FALSE(msg.empty()) << p.to_string() << " was accepted";
  for (const std::string& f : fragments) {
    EXPECT_NE(msg.find(f), std::string::npos) << "missing \"" << f << "\" in: " << msg;
  }
}

void ExpectAccepted(const ModelExecutePlan& p, int64_t num_layers, RunKind kind) {
  EXPECT_EQ(ValidateError(p, num_layers, kind), "") << p.to_string();
}

constexpr RunKind kAllKinds[] = {RunKind::kInfer, RunKind::kTrain, RunKind::kFused};

// --- validate: accepted plans -------------------------------------------------

TEST(PlanValidate, AcceptsValidPlansOfEachKind) {
  ExpectAccepted(Plan({{0, 2}, {2, 4}}, {}), 4, RunKind::kInfer);
  ExpectAccepted(Plan({{0, 4}}, {{0, 4}}), 4, RunKind::kInfer);
  ExpectAccepted(Plan({{0, 2}, {2, 4}}, {{3, 4}, {1, 3}, {0, 1}}), 4, RunKind::kTrain);
  ExpectAccepted(Plan({{0, 1}, {1, 3}}, {{3, 4}, {2, 3}, {0, 2}}), 4, RunKind::kFused);
  // The fused stage may hold every layer, leaving no forward stage.
  ExpectAccepted(Plan({}, {{0, 4}}), 4, RunKind::kFused);
  ExpectAccepted(Plan({{0, 1}}, {{0, 1}}), 1, RunKind::kInfer);
  ExpectAccepted(Plan({{0, 1}}, {{0, 1}}), 1, RunKind::kTrain);
  ExpectAccepted(Plan({}, {{0, 1}}), 1, RunKind::kFused);
}

// --- validate: one test per rule ------------------------------------------------

TEST(PlanValidate, RejectsModelWithoutLayers) {
  ExpectRejected(Plan({}, {}), 0, RunKind::kInfer, {"at least 1 layer", "num_layers=0"});
}

TEST(PlanValidate, ErrorsAreValueErrors) {
  EXPECT_THROW(Plan({}, {}).validate(4, RunKind::kTrain), c10::ValueError);
}

TEST(PlanValidate, RejectsEmptyRange) {
  ExpectRejected(Plan({{0, 2}, {2, 2}, {2, 4}}, {}), 4, RunKind::kInfer,
                 {"forward ranges must be non-empty", "range(2, 2)"});
  ExpectRejected(Plan({{0, 4}}, {{4, 3}, {0, 3}}), 4, RunKind::kTrain,
                 {"backward ranges must be non-empty", "range(4, 3)"});
}

TEST(PlanValidate, RejectsRangeOutsideModel) {
  ExpectRejected(Plan({{0, 2}, {2, 5}}, {}), 4, RunKind::kInfer,
                 {"forward ranges must lie inside", "range(0, 4)", "range(2, 5)"});
  ExpectRejected(Plan({{0, 4}}, {{0, 4}, {-1, 0}}), 4, RunKind::kTrain,
                 {"backward ranges must lie inside", "range(-1, 0)"});
}

TEST(PlanValidate, RejectsForwardNotStartingAtZero) {
  ExpectRejected(Plan({{1, 4}}, {}), 4, RunKind::kInfer,
                 {"forward ranges must start at layer 0", "range(1, 4)", "add range(0, 1)"});
}

TEST(PlanValidate, RejectsForwardGap) {
  ExpectRejected(Plan({{0, 2}, {3, 4}}, {}), 4, RunKind::kInfer,
                 {"forward ranges must be contiguous", "gap between range(0, 2) and range(3, 4)",
                  "layer 2 is in no range"});
}

TEST(PlanValidate, RejectsForwardOverlap) {
  ExpectRejected(Plan({{0, 3}, {1, 4}}, {}), 4, RunKind::kInfer,
                 {"forward ranges must not overlap", "layers range(1, 3) are in both",
                  "range(0, 3) and range(1, 4)"});
}

TEST(PlanValidate, RejectsForwardOutOfOrder) {
  ExpectRejected(Plan({{0, 2}, {2, 4}, {0, 1}}, {}), 4, RunKind::kInfer,
                 {"forward ranges must be ascending", "range(2, 4) is listed before range(0, 1)"});
}

TEST(PlanValidate, RejectsEmptyForwardForInferAndTrain) {
  for (RunKind kind : {RunKind::kInfer, RunKind::kTrain}) {
    ExpectRejected(Plan({}, {{0, 4}}), 4, kind, {"the forward plan is empty", "range(0, 4)"});
  }
}

TEST(PlanValidate, RejectsForwardNotReachingLastLayer) {
  for (RunKind kind : {RunKind::kInfer, RunKind::kTrain}) {
    ExpectRejected(Plan({{0, 3}}, {{0, 4}}), 4, kind,
                   {"forward ranges must end at the last layer", "range(0, 3)", "add range(3, 4)"});
  }
}

TEST(PlanValidate, RejectsEmptyBackwardForTrainAndFused) {
  ExpectRejected(Plan({{0, 4}}, {}), 4, RunKind::kTrain,
                 {"the backward plan is empty", "training", "range(0, 4)"});
  ExpectRejected(Plan({}, {}), 4, RunKind::kFused,
                 {"the backward plan is empty", "forward_backward()"});
}

TEST(PlanValidate, RejectsAscendingBackward) {
  ExpectRejected(Plan({{0, 4}}, {{0, 2}, {2, 4}}), 4, RunKind::kTrain,
                 {"backward ranges must be listed deepest first",
                  "range(0, 2) is listed before range(2, 4)", "reverse the list"});
}

TEST(PlanValidate, RejectsBackwardFirstNotDeepest) {
  ExpectRejected(Plan({{0, 4}}, {{1, 3}, {0, 1}}), 4, RunKind::kTrain,
                 {"the first must end at the last layer", "range(1, 3)", "layer 3 is in no range"});
}

TEST(PlanValidate, RejectsBackwardOutOfOrderMidList) {
  ExpectRejected(
      Plan({{0, 4}}, {{3, 4}, {1, 3}, {0, 1}, {1, 2}}), 4, RunKind::kTrain,
      {"backward ranges must be listed deepest first", "range(0, 1) is listed before range(1, 2)"});
}

TEST(PlanValidate, RejectsBackwardGap) {
  ExpectRejected(Plan({{0, 4}}, {{3, 4}, {0, 2}}), 4, RunKind::kTrain,
                 {"backward ranges must cover every layer exactly once",
                  "gap between range(0, 2) and range(3, 4)", "layer 2 is in no range"});
}

TEST(PlanValidate, RejectsBackwardOverlap) {
  ExpectRejected(Plan({{0, 5}}, {{3, 5}, {2, 4}, {0, 2}}), 5, RunKind::kTrain,
                 {"backward ranges must cover every layer exactly once",
                  "layer 3 is in both range(2, 4) and range(3, 5)"});
}

TEST(PlanValidate, RejectsBackwardNotReachingLayerZero) {
  ExpectRejected(Plan({{0, 4}}, {{3, 4}, {2, 3}}), 4, RunKind::kTrain,
                 {"backward ranges must cover every layer exactly once",
                  "layers range(0, 2) are in no range", "must begin at layer 0"});
}

TEST(PlanValidate, InferChecksAGivenBackwardPlan) {
  ExpectRejected(Plan({{0, 4}}, {{2, 4}}), 4, RunKind::kInfer,
                 {"backward ranges must cover every layer exactly once",
                  "layers range(0, 2) are in no range"});
}

TEST(PlanValidate, RejectsFusedStageNotEndingAtLastLayer) {
  ExpectRejected(
      Plan({}, {{0, 3}}), 4, RunKind::kFused,
      {"the fused stage (the first backward range) must end at the last layer", "range(0, 3)"});
}

TEST(PlanValidate, RejectsForwardNotEndingAtFusedStage) {
  ExpectRejected(Plan({{0, 2}}, {{3, 4}, {0, 3}}), 4, RunKind::kFused,
                 {"the forward plan must end exactly where the fused stage begins",
                  "range(0, 2) ends at layer 2 but the fused stage range(3, 4) begins at layer 3",
                  "make the forward ranges cover range(0, 3) and nothing more"});
  ExpectRejected(Plan({{0, 4}}, {{2, 4}, {0, 2}}), 4, RunKind::kFused,
                 {"must end exactly where the fused stage begins",
                  "range(0, 4) ends at layer 4 but the fused stage range(2, 4) begins at layer 2"});
  ExpectRejected(Plan({}, {{2, 4}, {0, 2}}), 4, RunKind::kFused,
                 {"the forward plan is empty but the fused stage is range(2, 4)",
                  "add forward ranges covering range(0, 2)"});
}

// --- to_string -------------------------------------------------------------------

TEST(PlanToString, PythonStyleRanges) {
  EXPECT_EQ(Plan({{0, 2}, {2, 4}}, {{3, 4}, {0, 3}}).to_string(),
            "fwd [range(0, 2), range(2, 4)] bwd [range(3, 4), range(0, 3)]");
  EXPECT_EQ(Plan({}, {}).to_string(), "fwd [] bwd []");
}

// --- default_plan ------------------------------------------------------------------

TEST(DefaultPlan, ValidDeterministicAndSizedForRandomInputs) {
  std::mt19937 rng(1234);
  for (int iter = 0; iter < 3000; ++iter) {
    const int64_t num_layers = std::uniform_int_distribution<int64_t>(1, 40)(rng);
    const int64_t devices = std::uniform_int_distribution<int64_t>(1, 8)(rng);
    const RunKind kind = kAllKinds[iter % 3];
    std::vector<int64_t> bytes(num_layers);
    const bool all_zero = iter % 7 == 0;
    for (int64_t& b : bytes) {
      // About a third zeros, the rest spanning several orders of magnitude.
      const int64_t r = std::uniform_int_distribution<int64_t>(0, 2)(rng);
      b = all_zero || r == 0 ? 0
                             : std::uniform_int_distribution<int64_t>(1, 1 << 20)(rng) >> (r * 8);
    }
    const ModelExecutePlan plan = default_plan(bytes, devices, kind);
    SCOPED_TRACE("L=" + std::to_string(num_layers) + " D=" + std::to_string(devices) +
                 " kind=" + std::to_string(static_cast<int>(kind)) + " " + plan.to_string());
    ASSERT_NO_THROW(plan.validate(num_layers, kind));
    EXPECT_EQ(plan, default_plan(bytes, devices, kind));

    const int64_t fwd_stages = std::min(num_layers, 2 * devices);
    const int64_t bwd_stages = std::min(num_layers, 3 * fwd_stages);
    switch (kind) {
      case RunKind::kInfer:
        EXPECT_EQ(static_cast<int64_t>(plan.fwd_plan.size()), fwd_stages);
        EXPECT_TRUE(plan.bwd_plan.empty());
        break;
      case RunKind::kTrain:
        EXPECT_EQ(static_cast<int64_t>(plan.fwd_plan.size()), fwd_stages);
        EXPECT_EQ(static_cast<int64_t>(plan.bwd_plan.size()), bwd_stages);
        break;
      case RunKind::kFused:
        EXPECT_EQ(static_cast<int64_t>(plan.bwd_plan.size()), bwd_stages);
        EXPECT_EQ(static_cast<int64_t>(plan.fwd_plan.size()),
                  std::min(plan.bwd_plan[0].begin, 2 * devices));
        break;
    }
  }
}

TEST(DefaultPlan, FusedFourEqualLayersOneDevice) {
  const ModelExecutePlan plan = default_plan({8, 8, 8, 8}, 1, RunKind::kFused);
  // Backward: min(4, 3 * min(4, 2)) = 4 single-layer stages, the deepest fused;
  // forward: [0, 3) in min(3, 2) = 2 stages.
  EXPECT_EQ(plan, Plan({{0, 1}, {1, 3}}, {{3, 4}, {2, 3}, {1, 2}, {0, 1}})) << plan.to_string();
}

TEST(DefaultPlan, TrainEightEqualLayersTwoDevices) {
  const ModelExecutePlan plan = default_plan(std::vector<int64_t>(8, 100), 2, RunKind::kTrain);
  EXPECT_EQ(plan, Plan({{0, 2}, {2, 4}, {4, 6}, {6, 8}},
                       {{7, 8}, {6, 7}, {5, 6}, {4, 5}, {3, 4}, {2, 3}, {1, 2}, {0, 1}}))
      << plan.to_string();
}

TEST(DefaultPlan, SplitsByBytesNotLayerCount) {
  EXPECT_EQ(default_plan({10, 1, 1, 1, 1, 10}, 1, RunKind::kInfer), Plan({{0, 3}, {3, 6}}, {}));
  EXPECT_EQ(default_plan({100, 1, 1, 1}, 1, RunKind::kInfer), Plan({{0, 1}, {1, 4}}, {}));
}

TEST(DefaultPlan, AllZeroBytesSplitByLayerCount) {
  EXPECT_EQ(default_plan(std::vector<int64_t>(6, 0), 1, RunKind::kInfer),
            Plan({{0, 3}, {3, 6}}, {}));
  EXPECT_EQ(default_plan(std::vector<int64_t>(9, 0), 2, RunKind::kInfer).fwd_plan,
            Ranges({{0, 2}, {2, 4}, {4, 7}, {7, 9}}));
}

TEST(DefaultPlan, EqualBytesGiveBalancedForwardStages) {
  for (int64_t devices = 1; devices <= 8; ++devices) {
    const int64_t stages = 2 * devices;
    for (int64_t per_stage = 1; per_stage <= 4; ++per_stage) {
      const int64_t num_layers = stages * per_stage;
      for (RunKind kind : {RunKind::kInfer, RunKind::kTrain}) {
        const ModelExecutePlan plan =
            default_plan(std::vector<int64_t>(num_layers, 7), devices, kind);
        for (const LayerRange& r : plan.fwd_plan) {
          EXPECT_LE(r.size(), 2 * per_stage) << plan.to_string();
        }
      }
    }
  }
}

// More devices than layers: as many stages as layers. A device count near
// INT64_MAX once overflowed 2 * devices (found by tests/fuzz/fuzz_plan).
TEST(DefaultPlan, HugeDeviceCountsGiveOneLayerPerStage) {
  const std::vector<int64_t> bytes{3, 1, 4, 1, 5};
  for (RunKind kind : kAllKinds) {
    const ModelExecutePlan few = default_plan(bytes, 5, kind);
    for (int64_t devices : {int64_t{6}, std::numeric_limits<int64_t>::max() / 2 + 1,
                            std::numeric_limits<int64_t>::max()}) {
      EXPECT_EQ(default_plan(bytes, devices, kind), few) << devices;
    }
  }
}

TEST(DefaultPlan, RejectsBadInputs) {
  auto message = [](const std::vector<int64_t>& bytes, int64_t devices) -> std::string {
    try {
      default_plan(bytes, devices, RunKind::kTrain);
    } catch (const c10::ValueError& e) {
      return e.what_without_backtrace();
    }
    return "";
  };
  EXPECT_NE(message({}, 1).find("at least 1 layer"), std::string::npos);
  EXPECT_NE(message({1, 2}, 0).find("at least 1 device"), std::string::npos);
  EXPECT_NE(message({1, -2}, 1).find("layer 1 has -2"), std::string::npos);
}

}  // namespace
}  // namespace roundpipe
