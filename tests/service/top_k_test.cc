// The top-k over the wire (StepOptions.top_k) end to end: ids and log-probs against a float64
// reference of each token's predicted distribution on the server's own W, for a one-device, a
// replicated and a sharded head, with ignored tokens, forward-only and counted; the first id the
// argmax and nothing else changed by a bit; exactly-once (replay bit for bit, another top_k
// ALREADY_EXISTS); k above 16 or the vocabulary INVALID_ARGUMENT with nothing counted.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kN = 37, kD = 12, kV = 41;
constexpr int64_t kIgnore = -100;

// Each token's logits and lse in float64.
struct RefLogits {
  std::vector<std::vector<double>> z;  // N x V
  std::vector<double> lse;
};

RefLogits Logits(const std::vector<float>& weight, const HostBatch& batch, int64_t d, int64_t v) {
  RefLogits r;
  for (int64_t t = 0; t < batch.n; ++t) {
    std::vector<double> z(v);
    for (int64_t j = 0; j < v; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < d; ++k) {
        dot += static_cast<double>(batch.hidden[t * d + k]) * weight[j * d + k];
      }
      z[j] = dot;
    }
    const double max = *std::max_element(z.begin(), z.end());
    double sum = 0;
    for (double x : z) sum += std::exp(x - max);
    r.lse.push_back(max + std::log(sum));
    r.z.push_back(std::move(z));
  }
  return r;
}

// The server's top-k against the reference. Ids: the reference's order (decreasing z, ties by
// increasing id), except that two ids may trade places where their float64 logits lie within
// what fp32 arithmetic over D terms cannot tell apart (a near-tie); each id at most once.
// Log-probs: the reference's k largest z_j - lse, within fp32 tolerance. Ignored tokens: -1 and 0.
void ExpectTopK(const client::StepResult& got, const RefLogits& want, const HostBatch& batch,
                int32_t k) {
  const int64_t v = static_cast<int64_t>(want.z[0].size());
  ASSERT_EQ(got.top_k, k);
  ASSERT_EQ(got.top_k_ids.size(), static_cast<size_t>(batch.n * k));
  ASSERT_EQ(got.top_k_logprobs.size(), static_cast<size_t>(batch.n * k));
  for (int64_t t = 0; t < batch.n; ++t) {
    SCOPED_TRACE(absl::StrCat("token ", t));
    const int32_t* ids = &got.top_k_ids[t * k];
    const float* lp = &got.top_k_logprobs[t * k];
    if (batch.targets[t] == kIgnore) {
      for (int i = 0; i < k; ++i) {
        EXPECT_EQ(ids[i], -1);
        EXPECT_EQ(lp[i], 0.0f);
      }
      continue;
    }
    const std::vector<double>& z = want.z[t];
    std::vector<int32_t> order(v);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&z](int32_t a, int32_t b) { return z[a] > z[b]; });
    std::vector<bool> seen(v, false);
    for (int i = 0; i < k; ++i) {
      ASSERT_GE(ids[i], 0);
      ASSERT_LT(ids[i], v);
      EXPECT_FALSE(seen[ids[i]]) << "id " << ids[i] << " twice";
      seen[ids[i]] = true;
      const double best = z[order[i]];
      if (ids[i] != order[i]) {
        EXPECT_LE(std::abs(best - z[ids[i]]), 1e-5 * std::max(1.0, std::abs(best)))
            << "place " << i << ": id " << ids[i] << " for " << order[i];
      }
      const double ref = best - want.lse[t];
      EXPECT_NEAR(lp[i], ref, 2e-5 * std::max(1.0, std::abs(ref))) << "place " << i;
      if (i > 0) EXPECT_LE(lp[i], lp[i - 1]) << "place " << i;
    }
  }
}

void ExpectSameTraining(const client::StepResult& with, const client::StepResult& without) {
  EXPECT_EQ(with.loss, without.loss);
  EXPECT_EQ(with.loss_sum, without.loss_sum);
  EXPECT_EQ(with.token_count, without.token_count);
  EXPECT_EQ(with.grad_hidden, without.grad_hidden);
  EXPECT_EQ(with.per_token_loss, without.per_token_loss);
}

v1::Placement Placed(v1::PlacementKind kind) {
  v1::Placement placement;
  placement.set_kind(kind);
  placement.set_devices(2);
  return placement;
}

class TopKTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server::ServerOptions options = TestServer::Options();
    options.devices = {0, 1};
    auto started = TestServer::StartWith(options);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = started->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    client_ = server_->NewClient();
  }

  static TestServer* server_;
  std::unique_ptr<client::Client> client_;
};
TestServer* TopKTest::server_ = nullptr;

struct Layout {
  std::string name;
  v1::Placement placement;
};

std::vector<Layout> Layouts() {
  return {{"one-device", v1::Placement()},
          {"replicated", Placed(v1::PLACEMENT_REPLICATED)},
          {"sharded", Placed(v1::PLACEMENT_SHARDED)}};
}

// Every layout, forward-only and counted, k of 1, 5 and 16: the reference's top-k, the argmax its
// first id, and the loss, dH and per-token losses bit for bit those without the top-k.
TEST_F(TopKTest, MatchesTheFloat64ReferenceOnEveryLayout) {
  uint64_t sequence = 0;
  for (const Layout& layout : Layouts()) {
    for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16}) {
      const std::string name = absl::StrCat("topk-", layout.name, "-", v1::DType_Name(dtype));
      auto head = CreateKnownHead(*client_, name, kV, kD, dtype, 21, 0.5, layout.placement);
      ASSERT_TRUE(head.ok()) << head.status();
      const HostBatch batch = MakeBatch(kN, kD, kV, dtype, 22, /*ignore_every=*/4, kIgnore);
      const RefLogits want = Logits(head->weight, batch, kD, kV);
      for (int32_t k : {1, 5, 16}) {
        for (bool forward_only : {true, false}) {
          SCOPED_TRACE(absl::StrCat(name, " k=", k, forward_only ? " forward-only" : " counted"));
          client::Microbatch plain = ToMicrobatch(name, "topk", ++sequence, batch);
          plain.options.set_return_per_token_loss(true);
          plain.options.set_forward_only(forward_only);
          client::Microbatch asked = plain;
          asked.sequence = ++sequence;
          asked.options.set_top_k(k);
          asked.options.add_token_outputs(v1::TOKEN_OUTPUT_ARGMAX);
          auto info_before = client_->GetHead(name);
          ASSERT_TRUE(info_before.ok());
          auto with = client_->Step(asked);
          ASSERT_TRUE(with.ok()) << with.status();
          ExpectTopK(*with, want, batch, k);
          for (int64_t t = 0; t < batch.n; ++t) {
            EXPECT_EQ(with->top_k_ids[t * k], with->per_token_argmax[t]) << "token " << t;
          }
          auto without = client_->Step(plain);
          ASSERT_TRUE(without.ok()) << without.status();
          EXPECT_EQ(without->top_k, 0);
          EXPECT_TRUE(without->top_k_ids.empty());
          EXPECT_TRUE(without->top_k_logprobs.empty());
          ExpectSameTraining(*with, *without);
          auto info_after = client_->GetHead(name);
          ASSERT_TRUE(info_after.ok());
          EXPECT_EQ(info_after->microbatches_total() - info_before->microbatches_total(),
                    forward_only ? 0u : 2u);
        }
      }
    }
  }
}

// A sharded head's top-k and outputs are the one-device head's on the same W: the same ids (up to
// near-ties, checked against the reference above) and log-probs within fp32 rounding.
TEST_F(TopKTest, ShardedAnswersAsOneDevice) {
  auto one = CreateKnownHead(*client_, "same-one", kV, kD, v1::DTYPE_FP32, 23);
  ASSERT_TRUE(one.ok()) << one.status();
  auto sharded = CreateKnownHead(*client_, "same-sharded", kV, kD, v1::DTYPE_FP32, 23, 0.5,
                                 Placed(v1::PLACEMENT_SHARDED));
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  ASSERT_EQ(one->weight, sharded->weight);
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 24, 3, kIgnore);
  const RefLogits want = Logits(one->weight, batch, kD, kV);
  std::vector<client::StepResult> got;
  for (const char* name : {"same-one", "same-sharded"}) {
    client::Microbatch mb = ToMicrobatch(name, "same", 1, batch);
    mb.options.set_top_k(7);
    for (v1::TokenOutput o : {v1::TOKEN_OUTPUT_LOGPROB, v1::TOKEN_OUTPUT_ENTROPY,
                              v1::TOKEN_OUTPUT_LSE, v1::TOKEN_OUTPUT_ARGMAX}) {
      mb.options.add_token_outputs(o);
    }
    mb.options.set_return_correct_count(true);
    auto r = client_->Step(mb);
    ASSERT_TRUE(r.ok()) << r.status();
    ExpectTopK(*r, want, batch, 7);
    got.push_back(std::move(*r));
  }
  const client::StepResult& a = got[0];
  const client::StepResult& b = got[1];
  EXPECT_EQ(a.token_count, b.token_count);
  EXPECT_EQ(a.correct_count, b.correct_count);
  std::vector<double> as_double(a.top_k_logprobs.begin(), a.top_k_logprobs.end());
  EXPECT_TRUE(AllClose(b.top_k_logprobs, as_double, 2e-5));
  for (auto [x, y] : {std::pair{&a.per_token_logprob, &b.per_token_logprob},
                      std::pair{&a.per_token_entropy, &b.per_token_entropy},
                      std::pair{&a.per_token_lse, &b.per_token_lse}}) {
    EXPECT_TRUE(AllClose(*y, std::vector<double>(x->begin(), x->end()), 2e-5));
  }
  for (int64_t t = 0; t < batch.n; ++t) {
    if (a.per_token_argmax[t] == b.per_token_argmax[t]) continue;
    const std::vector<double>& z = want.z[t];
    EXPECT_LE(std::abs(z[a.per_token_argmax[t]] - z[b.per_token_argmax[t]]), 1e-5) << "token " << t;
  }
}

// A sharded head's output statistics are workspace: HeadInfo.memory counts them once a
// micro-batch asks, at least 2 + 2k floats per token on each shard for each shard's slice.
TEST_F(TopKTest, ShardedOutputStatisticsCountAsWorkspace) {
  auto head = CreateKnownHead(*client_, "memory-sharded", kV, kD, v1::DTYPE_FP32, 31, 0.5,
                              Placed(v1::PLACEMENT_SHARDED));
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 32, 5, kIgnore);
  client::Microbatch plain = ToMicrobatch("memory-sharded", "", 0, batch);
  plain.options.set_forward_only(true);
  ASSERT_TRUE(client_->Step(plain).ok());
  auto before = client_->GetHead("memory-sharded");
  ASSERT_TRUE(before.ok());
  client::Microbatch asked = plain;
  asked.options.set_top_k(16);
  ASSERT_TRUE(client_->Step(asked).ok());
  auto after = client_->GetHead("memory-sharded");
  ASSERT_TRUE(after.ok());
  // Two shards, each holding both slices of (2 + 2 x 16) rows of kN floats (one chunk).
  const uint64_t output_stats = 2 * 2 * (2 + 2 * 16) * kN * sizeof(float);
  EXPECT_GE(after->memory().workspace_bytes(), before->memory().workspace_bytes() + output_stats);
  ASSERT_EQ(after->device_memory_size(), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_GE(after->device_memory(i).workspace_bytes(),
              before->device_memory(i).workspace_bytes() + output_stats / 2)
        << "shard " << i;
  }
}

// Replay answers the same top-k bit for bit, on one device and over shards; the same key with
// another top_k (or none) is a reused key.
TEST_F(TopKTest, ReplayIsBitForBitAndAnotherTopKIsAReusedKey) {
  for (const Layout& layout : Layouts()) {
    SCOPED_TRACE(layout.name);
    const std::string name = "replay-" + layout.name;
    auto head = CreateKnownHead(*client_, name, kV, kD, v1::DTYPE_BF16, 25, 0.5, layout.placement);
    ASSERT_TRUE(head.ok()) << head.status();
    const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_BF16, 26, 5, kIgnore);
    client::Microbatch mb = ToMicrobatch(name, "r", 1, batch);
    mb.options.set_top_k(4);
    auto first = client_->Step(mb);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_FALSE(first->replayed);
    auto replay = client_->Step(mb);
    ASSERT_TRUE(replay.ok()) << replay.status();
    EXPECT_TRUE(replay->replayed);
    EXPECT_EQ(replay->top_k, 4);
    EXPECT_EQ(replay->top_k_ids, first->top_k_ids);
    ASSERT_EQ(replay->top_k_logprobs.size(), first->top_k_logprobs.size());
    EXPECT_EQ(std::memcmp(replay->top_k_logprobs.data(), first->top_k_logprobs.data(),
                          first->top_k_logprobs.size() * sizeof(float)),
              0);
    EXPECT_EQ(replay->grad_hidden, first->grad_hidden);
    for (uint32_t other : {3u, 0u}) {
      client::Microbatch again = mb;
      again.options.set_top_k(other);
      auto reused = client_->Step(again);
      EXPECT_EQ(reused.status().code(), absl::StatusCode::kAlreadyExists) << reused.status();
      EXPECT_NE(reused.status().message().find("options"), std::string::npos) << reused.status();
    }
    auto info = client_->GetHead(name);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->microbatches_total(), 1u);
  }
}

// k = 17 (above the limit) and k above the vocabulary: INVALID_ARGUMENT before anything is
// computed or counted, the key left free; k equal to the vocabulary is the whole distribution.
TEST_F(TopKTest, KAboveTheLimitOrTheVocabularyIsInvalidArgumentAndCountsNothing) {
  constexpr int64_t v = 9;
  for (const Layout& layout : Layouts()) {
    SCOPED_TRACE(layout.name);
    const std::string name = "bad-k-" + layout.name;
    auto head = CreateKnownHead(*client_, name, v, kD, v1::DTYPE_FP32, 27, 0.5, layout.placement);
    ASSERT_TRUE(head.ok()) << head.status();
    const HostBatch batch = MakeBatch(kN, kD, v, v1::DTYPE_FP32, 28, 6, kIgnore);
    for (bool forward_only : {false, true}) {
      for (uint32_t k : {17u, 10u, 1000000u}) {
        SCOPED_TRACE(absl::StrCat("k=", k, forward_only ? " forward-only" : " counted"));
        client::Microbatch mb = ToMicrobatch(name, "b", 1, batch);
        mb.options.set_forward_only(forward_only);
        mb.options.set_top_k(k);
        auto refused = client_->Step(mb);
        EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
        EXPECT_NE(refused.status().message().find("options.top_k must be in [0, 16] and at most "
                                                  "the vocabulary (9), got " +
                                                  std::to_string(k)),
                  std::string::npos)
            << refused.status();
        auto info = client_->GetHead(name);
        ASSERT_TRUE(info.ok());
        EXPECT_EQ(info->microbatches_total(), 0u);
        EXPECT_EQ(info->tokens_since_pull(), 0u);
      }
    }
    auto pulled = client_->PullGradient(name, v1::DTYPE_FP32, /*reset=*/false);
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    EXPECT_EQ(pulled->summary.microbatch_count(), 0u);
    for (float x : Decode(pulled->data, v1::DTYPE_FP32)) ASSERT_EQ(x, 0.0f);
    // The key is free: with k = V the micro-batch is computed, the whole distribution sorted.
    client::Microbatch whole = ToMicrobatch(name, "b", 1, batch);
    whole.options.set_top_k(v);
    auto computed = client_->Step(whole);
    ASSERT_TRUE(computed.ok()) << computed.status();
    EXPECT_FALSE(computed->replayed);
    ExpectTopK(*computed, Logits(head->weight, batch, kD, v), batch, v);
  }
}

// Outputs larger than one message: the top-k chunked after the other tensors.
TEST(TopKChunkedTest, LargeTopKArrivesWholeOverManyMessages) {
  constexpr int64_t n = 2000, d = 8, v = 23;
  auto small = TestServer::Start(size_t{16} << 10);
  ASSERT_TRUE(small.ok()) << small.status();
  auto client = (*small)->NewClient();
  auto head = CreateKnownHead(*client, "chunked", v, d, v1::DTYPE_FP32, 29);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(n, d, v, v1::DTYPE_FP32, 30, 7, kIgnore);
  client::Microbatch mb = ToMicrobatch("chunked", "c", 1, batch);
  mb.options.set_return_per_token_loss(true);
  mb.options.add_token_outputs(v1::TOKEN_OUTPUT_LSE);
  mb.options.set_top_k(16);
  auto got = client->Step(mb);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectTopK(*got, Logits(head->weight, batch, d, v), batch, 16);
}

}  // namespace
}  // namespace losshead::testing
