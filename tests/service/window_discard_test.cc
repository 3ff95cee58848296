// The gradient window over gRPC without its data: PullGradient with summary_only answers one
// message carrying the summary and no bytes; with reset it discards the window (a trainer's
// zero_grad), after which only the micro-batches that follow are pulled, as the float64
// reference computes them. The window gauges and the discard counters on /metrics follow.
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

class WindowDiscardTest : public SharedServerTest<kTestServerMessageBytes, /*kMetrics=*/true> {
 protected:
  Exposition Scrape() {
    auto body = HttpGet(server_->metrics_port(), "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    auto e = ParseExposition(body.ok() ? *body : "");
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? *e : Exposition();
  }
};

TEST_F(WindowDiscardTest, DiscardDropsTheWindowAndTheNextPullHoldsOnlyWhatFollows) {
  constexpr int64_t v = 29, d = 8;
  auto head = CreateKnownHead(*client_, "discarded", v, d, v1::DTYPE_FP32, 4);
  ASSERT_TRUE(head.ok()) << head.status();
  std::vector<HostBatch> dropped, kept;
  uint64_t dropped_tokens = 0;
  for (int i = 0; i < 3; ++i) {
    dropped.push_back(MakeBatch(6 + i, d, v, v1::DTYPE_FP32, 40 + i, /*ignore_every=*/5));
    auto r = client_->Step(ToMicrobatch(head->name, "z", i + 1, dropped.back()));
    ASSERT_TRUE(r.ok()) << r.status();
    dropped_tokens += r->token_count;
  }

  auto summary = client_->WindowSummary(head->name);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->microbatch_count(), 3u);
  EXPECT_EQ(summary->token_count(), dropped_tokens);
  EXPECT_EQ(summary->total_bytes(), 0u);
  EXPECT_FALSE(summary->was_reset());
  absl::SleepFor(absl::Milliseconds(20));
  Exposition e = Scrape();
  EXPECT_EQ(e.Sum("losshead_window_microbatches", {{"head", head->name}}), 3);
  EXPECT_EQ(e.Sum("losshead_window_tokens", {{"head", head->name}}),
            static_cast<double>(dropped_tokens));
  EXPECT_GE(e.Sum("losshead_window_age_seconds", {{"head", head->name}}), 0.02);
  EXPECT_EQ(e.Sum("losshead_gradient_discards_total", {{"head", head->name}}), 0);

  auto discarded = client_->DiscardGradient(head->name);
  ASSERT_TRUE(discarded.ok()) << discarded.status();
  EXPECT_EQ(discarded->microbatch_count(), 3u);
  EXPECT_EQ(discarded->token_count(), dropped_tokens);
  EXPECT_EQ(discarded->min_weights_version(), head->version);
  EXPECT_EQ(discarded->total_bytes(), 0u);
  EXPECT_TRUE(discarded->was_reset());
  auto info = client_->GetHead(head->name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_since_pull(), 0u);
  e = Scrape();
  EXPECT_EQ(e.Sum("losshead_window_microbatches", {{"head", head->name}}), 0);
  EXPECT_EQ(e.Sum("losshead_window_age_seconds", {{"head", head->name}}), 0);
  EXPECT_EQ(e.Sum("losshead_gradient_discards_total", {{"head", head->name}}), 1);
  EXPECT_EQ(e.Sum("losshead_discarded_microbatches_total", {{"head", head->name}}), 3);
  EXPECT_EQ(e.Sum("losshead_discarded_tokens_total", {{"head", head->name}}),
            static_cast<double>(dropped_tokens));
  EXPECT_EQ(e.Sum("losshead_pulls_total", {{"head", head->name}}), 1);  // the summary

  std::vector<double> want(v * d, 0.0);
  for (int i = 0; i < 2; ++i) {
    kept.push_back(MakeBatch(5 + i, d, v, v1::DTYPE_FP32, 60 + i, /*ignore_every=*/4));
    ASSERT_TRUE(client_->Step(ToMicrobatch(head->name, "z", 10 + i, kept.back())).ok());
    const RefResult r = Reference(head->weight, kept.back().hidden, kept.back().targets,
                                  kept.back().n, d, v, RefOptions());
    for (size_t k = 0; k < want.size(); ++k) want[k] += r.grad_weight[k];
  }
  auto pulled = client_->PullGradient(head->name, v1::DTYPE_FP32, /*reset=*/true);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->summary.microbatch_count(), 2u);
  EXPECT_TRUE(
      AllClose(Decode(pulled->data, v1::DTYPE_FP32), want, ToleranceFor(v1::DTYPE_FP32).grad));
}

TEST_F(WindowDiscardTest, RefusalsChangeNothing) {
  auto head = CreateKnownHead(*client_, "kept", 13, 4, v1::DTYPE_BF16, 5);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(4, 4, 13, v1::DTYPE_BF16, 70);
  ASSERT_TRUE(client_->Step(ToMicrobatch(head->name, "r", 1, batch)).ok());
  EXPECT_EQ(client_->WindowSummary("no-such-head").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->DiscardGradient("no-such-head").status().code(), absl::StatusCode::kNotFound);
  auto info = client_->GetHead(head->name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_since_pull(), 1u);
}

}  // namespace
}  // namespace losshead::testing
