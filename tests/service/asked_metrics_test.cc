// The counters of what computed micro-batches asked for and ran (docs/metrics.md): per-token
// outputs by kind, top-k requests, loss kinds and terms, embedding rows served and received.
// Exact values after known requests; replays and refusals count nothing.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

TEST(AskedMetricsTest, CountWhatRanOnce) {
  auto server = TestServer::Start(size_t{4} << 20, /*metrics=*/true);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->NewClient();
  constexpr int64_t d = 16, v = 37;
  auto head = CreateKnownHead(*client, "asked", v, d, v1::DTYPE_FP32, 3);
  ASSERT_TRUE(head.ok()) << head.status();
  const std::string& name = head->name;

  // Cross-entropy with token weights, two token outputs and the top-k: 20 tokens.
  const HostBatch first = MakeBatch(20, d, v, v1::DTYPE_FP32, 30, 4);
  const std::vector<float> weights(20, 0.5f);
  client::Microbatch ce = ToMicrobatch(name, "m", 1, first);
  ce.options.add_token_outputs(v1::TOKEN_OUTPUT_LOGPROB);
  ce.options.add_token_outputs(v1::TOKEN_OUTPUT_ENTROPY);
  ce.options.set_top_k(3);
  ce.token_weights = weights;
  auto answered = client->Step(ce);
  ASSERT_TRUE(answered.ok()) << answered.status();
  auto replayed = client->Step(ce);  // the same key: replayed, counted nowhere here
  ASSERT_TRUE(replayed.ok() && replayed->replayed) << replayed.status();

  // Policy gradient with the KL and entropy terms and the argmax: 12 tokens.
  const HostBatch second = MakeBatch(12, d, v, v1::DTYPE_FP32, 31);
  const std::vector<float> old_logprob(12, -3.0f), advantages(12, 1.0f), ref(12, -3.5f);
  client::Microbatch pg = ToMicrobatch(name, "m", 2, second);
  pg.loss_options.set_kind(v1::LOSS_KIND_POLICY_GRADIENT);
  pg.loss_options.set_kl_coef(0.1f);
  pg.loss_options.set_entropy_coef(0.01f);
  pg.options.add_token_outputs(v1::TOKEN_OUTPUT_ARGMAX);
  pg.old_logprob = old_logprob;
  pg.advantages = advantages;
  pg.ref_logprob = ref;
  answered = client->Step(pg);
  ASSERT_TRUE(answered.ok()) << answered.status();

  // Refused: weights of the wrong length; a policy gradient without its advantages.
  const std::vector<float> short_weights(19, 1.0f);
  client::Microbatch bad = ToMicrobatch(name, "m", 3, first);
  bad.options.add_token_outputs(v1::TOKEN_OUTPUT_LSE);
  bad.options.set_top_k(2);
  bad.token_weights = short_weights;
  EXPECT_EQ(client->Step(bad).status().code(), absl::StatusCode::kInvalidArgument);
  client::Microbatch no_advantages = pg;
  no_advantages.sequence = 4;
  no_advantages.advantages = {};
  EXPECT_EQ(client->Step(no_advantages).status().code(), absl::StatusCode::kInvalidArgument);

  // Embedding rows served (4, one refused read of an id out of range) and received (5 once).
  const std::vector<int64_t> ids = {1, 2, 3, 1};
  ASSERT_TRUE(client->EmbeddingRows(name, ids).ok());
  const std::vector<int64_t> out_of_range = {1, v};
  EXPECT_EQ(client->EmbeddingRows(name, out_of_range).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<int64_t> grad_ids = {0, 5, 5, 36, 2};
  const std::vector<float> grad(grad_ids.size() * d, 0.25f);
  for (int i = 0; i < 2; ++i) {  // the second is a replay
    auto added = client->EmbeddingGrad(name, "m", 100, grad_ids, v1::DTYPE_FP32,
                                       std::as_bytes(std::span<const float>(grad)));
    ASSERT_TRUE(added.ok()) << added.status();
    EXPECT_EQ(added->replayed, i == 1);
  }
  auto refused = client->EmbeddingGrad(name, "m", 101, out_of_range, v1::DTYPE_FP32,
                                       std::as_bytes(std::span<const float>(grad).first(2 * d)));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);

  // Every micro-batch above is recorded once its error count is in: 2 replays, 3 errors.
  auto e = ScrapeWhen((*server)->metrics_port(), "losshead_microbatches_total",
                      {{"head", name}, {"outcome", "error"}}, 3);
  ASSERT_TRUE(e.ok()) << e.status();
  auto count = [&](const std::string& metric, std::map<std::string, std::string> labels) {
    labels["head"] = name;
    return e->Sum(metric, labels);
  };
  EXPECT_EQ(count("losshead_microbatches_total", {{"outcome", "replayed"}}), 2);
  EXPECT_EQ(count("losshead_token_output_tokens_total", {{"output", "logprob"}}), 20);
  EXPECT_EQ(count("losshead_token_output_tokens_total", {{"output", "entropy"}}), 20);
  EXPECT_EQ(count("losshead_token_output_tokens_total", {{"output", "argmax"}}), 12);
  EXPECT_EQ(count("losshead_token_output_tokens_total", {{"output", "lse"}}), 0);
  EXPECT_EQ(count("losshead_top_k_microbatches_total", {}), 1);
  EXPECT_EQ(count("losshead_loss_microbatches_total", {{"kind", "cross_entropy"}}), 1);
  EXPECT_EQ(count("losshead_loss_microbatches_total", {{"kind", "policy_gradient"}}), 1);
  EXPECT_EQ(count("losshead_loss_term_microbatches_total", {{"term", "token_weights"}}), 1);
  EXPECT_EQ(count("losshead_loss_term_microbatches_total", {{"term", "kl"}}), 1);
  EXPECT_EQ(count("losshead_loss_term_microbatches_total", {{"term", "entropy"}}), 1);
  EXPECT_EQ(count("losshead_embedding_rows_total", {}), 4);
  EXPECT_EQ(count("losshead_embedding_grad_rows_total", {}), 5);
  // An embedding gradient is no loss micro-batch.
  EXPECT_EQ(e->Sum("losshead_loss_microbatches_total", {{"head", name}}), 2);

  // Deleting the head drops its series.
  ASSERT_TRUE(client->DeleteHead(name).ok());
  auto after = ParseExposition(*HttpGet((*server)->metrics_port(), "/metrics"));
  ASSERT_TRUE(after.ok()) << after.status();
  for (const char* metric :
       {"losshead_token_output_tokens_total", "losshead_top_k_microbatches_total",
        "losshead_loss_microbatches_total", "losshead_loss_term_microbatches_total",
        "losshead_embedding_rows_total", "losshead_embedding_grad_rows_total"}) {
    EXPECT_TRUE(after->Find(metric, {{"head", name}}).empty()) << metric;
  }
}

}  // namespace
}  // namespace losshead::testing
