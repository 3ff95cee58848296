// Step results and pulled dW through the real server and client, against the float64 reference.
#include <cmath>
#include <memory>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/v1/wire_dtype.h"
#include "tests/service/host_tensors.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kN = 37, kD = 24, kV = 101;

class StepAccuracyTest : public SharedServerTest<> {
 protected:
  // Steps `batch` once on `head` with `step_options` and checks loss, dH, per-token loss and the
  // pulled dW against the reference under `ref`.
  void CheckOneStep(const KnownHead& head, const HostBatch& batch, const v1::StepOptions& options,
                    const v1::LossOptions& loss_options, const RefOptions& ref) {
    const RefResult want =
        Reference(head.weight, batch.hidden, batch.targets, batch.n, head.d, head.v, ref);
    const uint64_t sequence = ++sequence_;
    client::Microbatch mb = ToMicrobatch(head.name, "accuracy", sequence, batch);
    mb.options = options;
    mb.options.set_return_per_token_loss(true);
    mb.loss_options = loss_options;
    auto got = client_->Step(mb);
    ASSERT_TRUE(got.ok()) << got.status();
    const Tolerance tol = ToleranceFor(head.dtype);

    EXPECT_EQ(got->token_count, want.token_count);
    EXPECT_NEAR(got->loss_sum, want.loss_sum,
                tol.loss_rel * std::max(1.0, std::fabs(want.loss_sum)));
    EXPECT_NEAR(got->loss, want.loss, tol.loss_rel * std::max(1.0, std::fabs(want.loss)));
    EXPECT_EQ(got->weights_version, head.version);
    EXPECT_FALSE(got->replayed);
    EXPECT_EQ(got->client_id, "accuracy");
    EXPECT_EQ(got->sequence, sequence);

    const v1::DType gdtype = options.grad_hidden_dtype() == v1::DTYPE_UNSPECIFIED
                                 ? batch.dtype
                                 : options.grad_hidden_dtype();
    EXPECT_EQ(got->grad_hidden_dtype, gdtype);
    ASSERT_EQ(got->grad_hidden.size(),
              static_cast<size_t>(batch.n * head.d) * v1::WireDTypeSize(gdtype));
    EXPECT_TRUE(AllClose(Decode(got->grad_hidden, gdtype), want.grad_hidden,
                         ToleranceFor(gdtype).grad + tol.grad))
        << "dH";
    ASSERT_EQ(got->per_token_loss.size(), static_cast<size_t>(batch.n));
    EXPECT_TRUE(AllClose(got->per_token_loss, want.per_token_loss, tol.loss_rel * 10))
        << "per-token loss";

    auto pulled = client_->PullGradient(head.name, v1::DTYPE_FP32, /*reset=*/true);
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    const v1::GradientSummary& s = pulled->summary;
    EXPECT_EQ(s.vocab_size(), head.v);
    EXPECT_EQ(s.hidden_size(), head.d);
    EXPECT_EQ(s.dtype(), v1::DTYPE_FP32);
    EXPECT_EQ(s.token_count(), static_cast<uint64_t>(want.token_count));
    EXPECT_EQ(s.microbatch_count(), 1u);
    EXPECT_EQ(s.min_weights_version(), head.version);
    EXPECT_EQ(s.max_weights_version(), head.version);
    EXPECT_EQ(s.total_bytes(), static_cast<uint64_t>(head.v * head.d * 4));
    EXPECT_TRUE(s.was_reset());
    EXPECT_TRUE(AllClose(Decode(pulled->data, v1::DTYPE_FP32), want.grad_weight, tol.grad)) << "dW";
  }

  uint64_t sequence_ = 0;
};

struct Case {
  v1::DType dtype;
  v1::Reduction reduction;
  float label_smoothing;
};

// Keeps the discovered test names readable (gtest would print the struct's bytes).
void PrintTo(const Case& c, std::ostream* os) {
  *os << v1::DType_Name(c.dtype) << "/" << v1::Reduction_Name(c.reduction)
      << "/label_smoothing=" << c.label_smoothing;
}

class StepAccuracyCaseTest : public StepAccuracyTest, public ::testing::WithParamInterface<Case> {};

TEST_P(StepAccuracyCaseTest, MatchesFloat64Reference) {
  const Case c = GetParam();
  const std::string name =
      absl::StrCat("acc-", v1::DType_Name(c.dtype), "-", v1::Reduction_Name(c.reduction), "-",
                   c.label_smoothing > 0 ? "ls" : "plain");
  auto head = CreateKnownHead(*client_, name, kV, kD, c.dtype, 11);
  ASSERT_TRUE(head.ok()) << head.status();
  // Every 5th target ignored (-100), the built-in default ignore_index.
  const HostBatch batch = MakeBatch(kN, kD, kV, c.dtype, 12, /*ignore_every=*/5);

  v1::StepOptions options;
  options.set_reduction(c.reduction);
  options.set_grad_scale(0.5f);
  v1::LossOptions loss_options;
  if (c.label_smoothing > 0) loss_options.set_label_smoothing(c.label_smoothing);
  RefOptions ref{.reduction = c.reduction, .grad_scale = 0.5, .label_smoothing = c.label_smoothing};
  CheckOneStep(*head, batch, options, loss_options, ref);
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return absl::StrCat(info.param.dtype == v1::DTYPE_BF16 ? "Bf16" : "Fp32", "_N37_D24_V101_",
                      v1::Reduction_Name(info.param.reduction).substr(10),
                      info.param.label_smoothing > 0 ? "_LabelSmoothing" : "");
}

INSTANTIATE_TEST_SUITE_P(DtypesReductionsSmoothing, StepAccuracyCaseTest,
                         ::testing::Values(Case{v1::DTYPE_FP32, v1::REDUCTION_MEAN, 0.0f},
                                           Case{v1::DTYPE_FP32, v1::REDUCTION_SUM, 0.0f},
                                           Case{v1::DTYPE_FP32, v1::REDUCTION_NONE, 0.0f},
                                           Case{v1::DTYPE_FP32, v1::REDUCTION_MEAN, 0.1f},
                                           Case{v1::DTYPE_BF16, v1::REDUCTION_MEAN, 0.0f},
                                           Case{v1::DTYPE_BF16, v1::REDUCTION_SUM, 0.0f},
                                           Case{v1::DTYPE_BF16, v1::REDUCTION_NONE, 0.0f},
                                           Case{v1::DTYPE_BF16, v1::REDUCTION_SUM, 0.1f}),
                         CaseName);

TEST_F(StepAccuracyTest, HeadDefaultsApplyAndRequestOverridesWin) {
  auto head = CreateKnownHead(*client_, "acc-defaults", kV, kD, v1::DTYPE_FP32, 21);
  ASSERT_TRUE(head.ok()) << head.status();
  v1::LossOptions defaults;
  defaults.set_ignore_index(7);
  defaults.set_reduction(v1::REDUCTION_SUM);
  defaults.set_label_smoothing(0.05f);
  auto info = client_->SetLossOptions(head->name, defaults);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->spec().default_options().ignore_index(), 7);

  // Targets equal to 7 are ignored by the head's default.
  HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 22);
  std::vector<int64_t> targets = batch.targets;
  for (int64_t i = 0; i < kN; i += 4) targets[i] = 7;
  SetTargets(batch, targets);
  CheckOneStep(
      *head, batch, {}, {},
      RefOptions{.ignore_index = 7, .reduction = v1::REDUCTION_SUM, .label_smoothing = 0.05});

  // The request overrides: MEAN, no smoothing, z-loss and a soft-cap; ignore_index stays 7.
  v1::StepOptions options;
  options.set_reduction(v1::REDUCTION_MEAN);
  v1::LossOptions overrides;
  overrides.set_label_smoothing(0.0f);
  overrides.set_z_loss(1e-3f);
  overrides.set_logit_softcap(3.0f);
  CheckOneStep(
      *head, batch, options, overrides,
      RefOptions{
          .ignore_index = 7, .reduction = v1::REDUCTION_MEAN, .z_loss = 1e-3, .softcap = 3.0});
}

TEST_F(StepAccuracyTest, Int64TargetsAndFp32GradHiddenFromBf16) {
  auto head = CreateKnownHead(*client_, "acc-int64", kV, kD, v1::DTYPE_BF16, 31);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch =
      MakeBatch(kN, kD, kV, v1::DTYPE_BF16, 32, /*ignore_every=*/3, -100, v1::DTYPE_INT64);
  v1::StepOptions options;
  options.set_grad_hidden_dtype(v1::DTYPE_FP32);
  CheckOneStep(*head, batch, options, {}, RefOptions{});
}

TEST_F(StepAccuracyTest, SkipGradHiddenReturnsNoDhButAccumulatesDw) {
  auto head = CreateKnownHead(*client_, "acc-skip", kV, kD, v1::DTYPE_FP32, 41);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 42);
  client::Microbatch mb = ToMicrobatch(head->name, "skip", 1, batch);
  mb.options.set_skip_grad_hidden(true);
  auto got = client_->Step(mb);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->grad_hidden.empty());
  const RefResult want =
      Reference(head->weight, batch.hidden, batch.targets, kN, kD, kV, RefOptions{});
  EXPECT_NEAR(got->loss, want.loss, 1e-5 * want.loss);
  auto pulled = client_->PullGradient(head->name, v1::DTYPE_FP32, true);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_TRUE(AllClose(Decode(pulled->data, v1::DTYPE_FP32), want.grad_weight, 1e-4));
}

}  // namespace
}  // namespace losshead::testing
