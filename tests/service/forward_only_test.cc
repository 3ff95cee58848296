// Forward-only micro-batches (evaluation): the loss and dH of a counted step, bit for bit, with dW,
// the counters and the idempotency state left exactly as they were; bad input still gets its exact
// code.
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kN = 27, kD = 12, kV = 43;

client::Microbatch ForwardOnly(client::Microbatch mb) {
  mb.options.set_forward_only(true);
  return mb;
}

class ForwardOnlyTest : public SharedServerTest<> {
 protected:
  // Everything a forward-only micro-batch must leave alone.
  struct State {
    v1::HeadInfo info;
    client::PulledGradient gradient;
  };
  State Take(const std::string& head) {
    State s;
    auto info = client_->GetHead(head);
    auto gradient = client_->PullGradient(head, v1::DTYPE_FP32, /*reset=*/false);
    EXPECT_TRUE(info.ok()) << info.status();
    EXPECT_TRUE(gradient.ok()) << gradient.status();
    if (info.ok()) s.info = *info;
    if (gradient.ok()) s.gradient = *gradient;
    return s;
  }
  void ExpectUnchanged(const std::string& head, const State& before) {
    const State now = Take(head);
    EXPECT_EQ(now.info.weights_version(), before.info.weights_version());
    EXPECT_EQ(now.info.tokens_since_pull(), before.info.tokens_since_pull());
    EXPECT_EQ(now.info.microbatches_since_pull(), before.info.microbatches_since_pull());
    EXPECT_EQ(now.info.tokens_total(), before.info.tokens_total());
    EXPECT_EQ(now.info.microbatches_total(), before.info.microbatches_total());
    EXPECT_EQ(now.gradient.summary.token_count(), before.gradient.summary.token_count());
    EXPECT_EQ(now.gradient.summary.microbatch_count(), before.gradient.summary.microbatch_count());
    EXPECT_EQ(now.gradient.summary.min_weights_version(),
              before.gradient.summary.min_weights_version());
    EXPECT_EQ(now.gradient.summary.max_weights_version(),
              before.gradient.summary.max_weights_version());
    EXPECT_EQ(now.gradient.data, before.gradient.data);
  }
};

void ExpectSameAnswer(const client::StepResult& forward, const client::StepResult& counted) {
  // Bit-identical: the same run, only without the dW GEMM.
  EXPECT_EQ(forward.loss, counted.loss);
  EXPECT_EQ(forward.loss_sum, counted.loss_sum);
  EXPECT_EQ(forward.token_count, counted.token_count);
  EXPECT_EQ(forward.weights_version, counted.weights_version);
  EXPECT_EQ(forward.grad_hidden_dtype, counted.grad_hidden_dtype);
  EXPECT_EQ(forward.grad_hidden, counted.grad_hidden);
  EXPECT_EQ(forward.per_token_loss, counted.per_token_loss);
}

TEST_F(ForwardOnlyTest, SameLossAndGradHiddenAsACountedStepAndNothingAccumulates) {
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16}) {
    SCOPED_TRACE(v1::DType_Name(dtype));
    const std::string name = "same-" + v1::DType_Name(dtype);
    auto head = CreateKnownHead(*client_, name, kV, kD, dtype, 1);
    ASSERT_TRUE(head.ok()) << head.status();
    const HostBatch batch = MakeBatch(kN, kD, kV, dtype, 2, /*ignore_every=*/4);
    client::Microbatch mb = ToMicrobatch(name, "eval", 1, batch);
    mb.options.set_return_per_token_loss(true);

    // On a pristine head: pull shows zero tokens and an all-zero dW afterwards.
    const State pristine = Take(name);
    auto forward = client_->Step(ForwardOnly(mb));
    ASSERT_TRUE(forward.ok()) << forward.status();
    EXPECT_TRUE(forward->forward_only);
    EXPECT_FALSE(forward->replayed);
    EXPECT_EQ(forward->weights_version, head->version);
    EXPECT_GT(forward->token_count, 0);
    EXPECT_EQ(forward->grad_hidden.size(), batch.hidden_bytes.size());
    ExpectUnchanged(name, pristine);
    const State after_forward = Take(name);
    EXPECT_EQ(after_forward.info.tokens_total(), 0u);
    EXPECT_EQ(after_forward.gradient.summary.token_count(), 0u);
    EXPECT_EQ(after_forward.gradient.summary.microbatch_count(), 0u);
    for (float x : Decode(after_forward.gradient.data, v1::DTYPE_FP32)) ASSERT_EQ(x, 0.0f);

    // The counted step on the same input gives the same answer, and does accumulate.
    auto counted = client_->Step(mb);
    ASSERT_TRUE(counted.ok()) << counted.status();
    EXPECT_FALSE(counted->forward_only);
    ExpectSameAnswer(*forward, *counted);
    const State after_counted = Take(name);
    EXPECT_EQ(after_counted.gradient.summary.token_count(),
              static_cast<uint64_t>(counted->token_count));
    EXPECT_EQ(after_counted.info.microbatches_since_pull(), 1u);

    // With something accumulated, evaluating (dH or not) leaves dW and every counter alone.
    auto again = client_->Step(ForwardOnly(mb));
    ASSERT_TRUE(again.ok()) << again.status();
    ExpectSameAnswer(*again, *counted);
    client::Microbatch no_dh = ForwardOnly(mb);
    no_dh.options.set_skip_grad_hidden(true);
    auto loss_only = client_->Step(no_dh);
    ASSERT_TRUE(loss_only.ok()) << loss_only.status();
    EXPECT_TRUE(loss_only->grad_hidden.empty());
    EXPECT_EQ(loss_only->loss, counted->loss);
    EXPECT_EQ(loss_only->loss_sum, counted->loss_sum);
    EXPECT_EQ(loss_only->token_count, counted->token_count);
    EXPECT_EQ(loss_only->per_token_loss, counted->per_token_loss);
    ExpectUnchanged(name, after_counted);
  }
}

TEST_F(ForwardOnlyTest, ReductionsAndLossOptionsMatchTheCountedStep) {
  auto head = CreateKnownHead(*client_, "options", kV, kD, v1::DTYPE_FP32, 3);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 4, /*ignore_every=*/5);
  for (v1::Reduction reduction : {v1::REDUCTION_MEAN, v1::REDUCTION_SUM, v1::REDUCTION_NONE}) {
    SCOPED_TRACE(v1::Reduction_Name(reduction));
    client::Microbatch mb = ToMicrobatch(head->name, "", 0, batch);
    mb.options.set_reduction(reduction);
    mb.options.set_grad_scale(0.5f);
    mb.options.set_grad_hidden_dtype(v1::DTYPE_BF16);
    mb.loss_options.set_label_smoothing(0.1f);
    mb.loss_options.set_z_loss(1e-3f);
    mb.loss_options.set_logit_softcap(3.0f);
    const State before = Take(head->name);
    auto forward = client_->Step(ForwardOnly(mb));
    ASSERT_TRUE(forward.ok()) << forward.status();
    ExpectUnchanged(head->name, before);
    auto counted = client_->Step(mb);
    ASSERT_TRUE(counted.ok()) << counted.status();
    ExpectSameAnswer(*forward, *counted);
  }
}

TEST_F(ForwardOnlyTest, BypassesIdempotencyBothWays) {
  auto head = CreateKnownHead(*client_, "keys", kV, kD, v1::DTYPE_FP32, 5);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 6);
  const HostBatch other = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 7);

  // A key remembered from a counted step: forward-only with it is computed on its own input, not
  // answered from the cache, and the counted step's replay is still the original answer.
  auto counted = client_->Step(ToMicrobatch(head->name, "trainer", 7, batch));
  ASSERT_TRUE(counted.ok()) << counted.status();
  const State before = Take(head->name);
  auto forward = client_->Step(ForwardOnly(ToMicrobatch(head->name, "trainer", 7, other)));
  ASSERT_TRUE(forward.ok()) << forward.status();
  EXPECT_FALSE(forward->replayed);
  EXPECT_TRUE(forward->forward_only);
  EXPECT_NE(forward->loss_sum, counted->loss_sum);
  ExpectUnchanged(head->name, before);
  auto replay = client_->Step(ToMicrobatch(head->name, "trainer", 7, batch));
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->replayed);
  EXPECT_EQ(replay->loss_sum, counted->loss_sum);
  EXPECT_EQ(replay->grad_hidden, counted->grad_hidden);

  // A forward-only key is not remembered: the same key counted later is new work, and a repeat
  // of the forward-only micro-batch recomputes.
  auto eval = client_->Step(ForwardOnly(ToMicrobatch(head->name, "fresh", 1, batch)));
  ASSERT_TRUE(eval.ok()) << eval.status();
  auto eval_again = client_->Step(ForwardOnly(ToMicrobatch(head->name, "fresh", 1, batch)));
  ASSERT_TRUE(eval_again.ok()) << eval_again.status();
  EXPECT_FALSE(eval_again->replayed);
  EXPECT_EQ(eval_again->loss_sum, eval->loss_sum);
  auto progress = client_->GetClientProgress(head->name, "fresh");
  ASSERT_TRUE(progress.ok()) << progress.status();
  EXPECT_FALSE(progress->has_acknowledged_sequence());
  auto train = client_->Step(ToMicrobatch(head->name, "fresh", 1, batch));
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_FALSE(train->replayed);
  EXPECT_FALSE(train->forward_only);
  auto info = client_->GetHead(head->name);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->microbatches_since_pull(), 2u);
}

TEST_F(ForwardOnlyTest, RunsAgainstTheCurrentWeightsVersion) {
  auto head = CreateKnownHead(*client_, "versions", kV, kD, v1::DTYPE_FP32, 8);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 9);
  client::Microbatch mb = ForwardOnly(ToMicrobatch(head->name, "", 0, batch));
  auto before = client_->Step(mb);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->weights_version, head->version);

  const std::vector<float> w2 = RandomValues(kV * kD, 0.5, v1::DTYPE_FP32, 10);
  const client::Bytes w2_bytes = Encode(w2, v1::DTYPE_FP32);
  auto pushed = client_->UploadWeights(head->name, v1::DTYPE_FP32, w2_bytes);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  auto after = client_->Step(mb);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->weights_version, *pushed);
  EXPECT_NE(after->loss_sum, before->loss_sum);

  mb.options.set_expected_weights_version(*pushed);
  EXPECT_TRUE(client_->Step(mb).ok());
  mb.options.set_expected_weights_version(head->version);
  EXPECT_EQ(client_->Step(mb).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ForwardOnlyTest, BadInputGetsTheSameCodesAndChangesNothing) {
  auto head = CreateKnownHead(*client_, "errors", kV, kD, v1::DTYPE_FP32, 11);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch good = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 12);
  ASSERT_TRUE(client_->Step(ToMicrobatch(head->name, "e", 1, good)).ok());
  const State before = Take(head->name);
  auto expect_code = [&](const client::Microbatch& mb, absl::StatusCode code) {
    auto counted = client_->Step(mb);
    auto forward = client_->Step(ForwardOnly(mb));
    EXPECT_EQ(counted.status().code(), code) << counted.status();
    EXPECT_EQ(forward.status().code(), code) << forward.status();
  };

  client::Microbatch unknown = ToMicrobatch("no-such-head", "e", 2, good);
  expect_code(unknown, absl::StatusCode::kNotFound);

  client::Microbatch zero = ToMicrobatch(head->name, "e", 3, good);
  zero.num_tokens = 0;
  expect_code(zero, absl::StatusCode::kInvalidArgument);

  client::Microbatch short_hidden = ToMicrobatch(head->name, "e", 4, good);
  short_hidden.hidden = short_hidden.hidden.first(short_hidden.hidden.size() - 4);
  expect_code(short_hidden, absl::StatusCode::kInvalidArgument);

  HostBatch out_of_range = good;
  std::vector<int64_t> targets = good.targets;
  targets[3] = kV;
  SetTargets(out_of_range, targets);
  expect_code(ToMicrobatch(head->name, "e", 5, out_of_range), absl::StatusCode::kInvalidArgument);

  HostBatch nan = good;
  nan.hidden[5] = std::numeric_limits<float>::quiet_NaN();
  nan.hidden_bytes = Encode(nan.hidden, v1::DTYPE_FP32);
  expect_code(ToMicrobatch(head->name, "e", 6, nan), absl::StatusCode::kInvalidArgument);

  client::Microbatch bad_dtype = ToMicrobatch(head->name, "e", 7, good);
  bad_dtype.options.set_grad_hidden_dtype(v1::DTYPE_INT32);
  expect_code(bad_dtype, absl::StatusCode::kInvalidArgument);

  client::Microbatch bad_smoothing = ToMicrobatch(head->name, "e", 8, good);
  bad_smoothing.loss_options.set_label_smoothing(1.5f);
  expect_code(bad_smoothing, absl::StatusCode::kInvalidArgument);

  client::Microbatch stale = ToMicrobatch(head->name, "e", 9, good);
  stale.options.set_expected_weights_version(head->version + 5);
  expect_code(stale, absl::StatusCode::kFailedPrecondition);

  ExpectUnchanged(head->name, before);
}

TEST(ForwardOnlyMetricsTest, CountedAsOutcomeForwardWithTheirTokens) {
  auto server = TestServer::Start(kTestServerMessageBytes, /*metrics=*/true);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->NewClient();
  auto head = CreateKnownHead(*client, "evaluated", kV, kD, v1::DTYPE_BF16, 13);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_BF16, 14, /*ignore_every=*/3);
  auto counted = client->Step(ToMicrobatch(head->name, "m", 1, batch));
  ASSERT_TRUE(counted.ok()) << counted.status();
  for (uint64_t seq : {1, 2}) {
    auto forward = client->Step(ForwardOnly(ToMicrobatch(head->name, "m", seq, batch)));
    ASSERT_TRUE(forward.ok()) << forward.status();
  }
  auto body = HttpGet((*server)->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  auto e = ParseExposition(*body);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->Sum("losshead_microbatches_total", {{"head", "evaluated"}, {"outcome", "ok"}}), 1);
  EXPECT_EQ(e->Sum("losshead_microbatches_total", {{"head", "evaluated"}, {"outcome", "forward"}}),
            2);
  EXPECT_EQ(
      e->Sum("losshead_microbatches_total", {{"head", "evaluated"}, {"outcome", "replayed"}}), 0);
  EXPECT_EQ(e->Sum("losshead_tokens_total", {{"head", "evaluated"}}),
            3.0 * static_cast<double>(counted->token_count));
}

}  // namespace
}  // namespace losshead::testing
