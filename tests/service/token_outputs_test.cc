// Token outputs (StepOptions.token_outputs, return_correct_count) end to end: every output against
// a float64 reference of the predicted distribution on the server's own W, with ignored tokens,
// with and without forward_only and for every reduction; the loss, dH and per-token losses bit for
// bit those of the same micro-batch without them; exactly-once (replay bit for bit, a repeat
// asking other outputs ALREADY_EXISTS); bad values INVALID_ARGUMENT; replicated and sharded heads
// as one device.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kN = 29, kD = 12, kV = 41;
constexpr int64_t kIgnore = -100;

// The predicted distribution of each token in float64, from the definitions in the proto.
struct RefOutputs {
  std::vector<double> logprob, entropy, lse;
  std::vector<std::vector<double>> logits;  // N x V
  std::vector<int32_t> argmax;
  int64_t correct = 0;
};

RefOutputs Distribution(const std::vector<float>& weight, const HostBatch& batch, int64_t d,
                        int64_t v) {
  RefOutputs r;
  for (int64_t t = 0; t < batch.n; ++t) {
    std::vector<double> z(v);
    for (int64_t j = 0; j < v; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < d; ++k) {
        dot += static_cast<double>(batch.hidden[t * d + k]) * weight[j * d + k];
      }
      z[j] = dot;
    }
    double max = -std::numeric_limits<double>::infinity();
    int32_t best = 0;
    for (int64_t j = 0; j < v; ++j) {
      if (z[j] > max) {
        max = z[j];
        best = static_cast<int32_t>(j);
      }
    }
    double sum = 0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(z[j] - max);
    const double lse = max + std::log(sum);
    double pz = 0;
    for (int64_t j = 0; j < v; ++j) pz += std::exp(z[j] - lse) * z[j];
    const int64_t y = batch.targets[t];
    const bool ignored = y == kIgnore;
    r.lse.push_back(lse);
    r.logprob.push_back(ignored ? 0.0 : z[y] - lse);
    r.entropy.push_back(ignored ? 0.0 : lse - pz);
    r.argmax.push_back(ignored ? -1 : best);
    if (!ignored && best == y) ++r.correct;
    r.logits.push_back(std::move(z));
  }
  return r;
}

void AskAll(client::Microbatch& mb) {
  for (v1::TokenOutput o : {v1::TOKEN_OUTPUT_LOGPROB, v1::TOKEN_OUTPUT_ENTROPY,
                            v1::TOKEN_OUTPUT_LSE, v1::TOKEN_OUTPUT_ARGMAX}) {
    mb.options.add_token_outputs(o);
  }
  mb.options.set_return_correct_count(true);
}

// The server's outputs against the reference: fp32 arithmetic over D and V terms, so a tolerance
// relative to the logits' scale; an argmax may differ from the float64 one only between logits
// that the reference itself cannot tell apart at fp32 precision.
void ExpectOutputs(const client::StepResult& got, const RefOutputs& want, const HostBatch& batch) {
  ASSERT_EQ(got.per_token_logprob.size(), static_cast<size_t>(batch.n));
  ASSERT_EQ(got.per_token_entropy.size(), static_cast<size_t>(batch.n));
  ASSERT_EQ(got.per_token_lse.size(), static_cast<size_t>(batch.n));
  ASSERT_EQ(got.per_token_argmax.size(), static_cast<size_t>(batch.n));
  ASSERT_TRUE(got.correct_count.has_value());
  constexpr double kTol = 2e-5;
  EXPECT_TRUE(AllClose(got.per_token_logprob, want.logprob, kTol));
  EXPECT_TRUE(AllClose(got.per_token_entropy, want.entropy, kTol));
  EXPECT_TRUE(AllClose(got.per_token_lse, want.lse, kTol));
  int64_t correct = 0;
  for (int64_t t = 0; t < batch.n; ++t) {
    const int32_t a = got.per_token_argmax[t];
    if (batch.targets[t] == kIgnore) {
      EXPECT_EQ(a, -1) << "token " << t;
      EXPECT_EQ(got.per_token_logprob[t], 0.0f) << "token " << t;
      EXPECT_EQ(got.per_token_entropy[t], 0.0f) << "token " << t;
      continue;
    }
    ASSERT_GE(a, 0);
    ASSERT_LT(a, kV);
    if (a != want.argmax[t]) {
      const double best = want.logits[t][want.argmax[t]];
      EXPECT_LE(best - want.logits[t][a], 1e-5 * std::max(1.0, std::abs(best))) << "token " << t;
    }
    if (a == batch.targets[t]) ++correct;
  }
  EXPECT_EQ(*got.correct_count, correct);  // consistent with the argmax it returned
  EXPECT_EQ(*got.correct_count, want.correct);
}

void ExpectSameTraining(const client::StepResult& with, const client::StepResult& without) {
  EXPECT_EQ(with.loss, without.loss);
  EXPECT_EQ(with.loss_sum, without.loss_sum);
  EXPECT_EQ(with.token_count, without.token_count);
  EXPECT_EQ(with.grad_hidden, without.grad_hidden);
  EXPECT_EQ(with.per_token_loss, without.per_token_loss);
}

class TokenOutputsTest : public SharedServerTest<> {};

TEST_F(TokenOutputsTest, MatchTheFloat64DistributionAndChangeNothingElse) {
  uint64_t sequence = 0;
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16}) {
    const std::string name = "outputs-" + v1::DType_Name(dtype);
    auto head = CreateKnownHead(*client_, name, kV, kD, dtype, 3, 0.4);
    ASSERT_TRUE(head.ok()) << head.status();
    const HostBatch batch = MakeBatch(kN, kD, kV, dtype, 11, /*ignore_every=*/5, kIgnore);
    const RefOutputs want = Distribution(head->weight, batch, kD, kV);
    for (v1::Reduction reduction : {v1::REDUCTION_MEAN, v1::REDUCTION_SUM, v1::REDUCTION_NONE}) {
      for (bool forward_only : {false, true}) {
        SCOPED_TRACE(absl::StrCat(v1::DType_Name(dtype), " ", v1::Reduction_Name(reduction),
                                  forward_only ? " forward-only" : " counted"));
        client::Microbatch plain = ToMicrobatch(name, "outputs", ++sequence, batch);
        plain.options.set_reduction(reduction);
        plain.options.set_return_per_token_loss(true);
        plain.options.set_forward_only(forward_only);
        client::Microbatch asked = plain;
        asked.sequence = ++sequence;
        AskAll(asked);
        auto info_before = client_->GetHead(name);
        ASSERT_TRUE(info_before.ok());
        auto with = client_->Step(asked);
        ASSERT_TRUE(with.ok()) << with.status();
        EXPECT_EQ(with->forward_only, forward_only);
        ExpectOutputs(*with, want, batch);
        auto without = client_->Step(plain);
        ASSERT_TRUE(without.ok()) << without.status();
        EXPECT_TRUE(without->per_token_logprob.empty());
        EXPECT_TRUE(without->per_token_argmax.empty());
        EXPECT_FALSE(without->correct_count.has_value());
        ExpectSameTraining(*with, *without);
        auto info_after = client_->GetHead(name);
        ASSERT_TRUE(info_after.ok());
        // Counted steps count once each, outputs or not; forward-only ones not at all.
        EXPECT_EQ(info_after->microbatches_total() - info_before->microbatches_total(),
                  forward_only ? 0u : 2u);
      }
    }
  }
}

TEST_F(TokenOutputsTest, EachOutputAloneIsTheSameAsAskedTogether) {
  auto head = CreateKnownHead(*client_, "alone", kV, kD, v1::DTYPE_BF16, 4);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_BF16, 12, 3, kIgnore);
  client::Microbatch all = ToMicrobatch("alone", "", 0, batch);
  all.options.set_forward_only(true);
  all.options.set_skip_grad_hidden(true);
  AskAll(all);
  auto together = client_->Step(all);
  ASSERT_TRUE(together.ok()) << together.status();
  for (v1::TokenOutput o : {v1::TOKEN_OUTPUT_LOGPROB, v1::TOKEN_OUTPUT_ENTROPY,
                            v1::TOKEN_OUTPUT_LSE, v1::TOKEN_OUTPUT_ARGMAX}) {
    SCOPED_TRACE(v1::TokenOutput_Name(o));
    client::Microbatch one = all;
    one.options.clear_token_outputs();
    one.options.set_return_correct_count(false);
    one.options.add_token_outputs(o);
    auto alone = client_->Step(one);
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_FALSE(alone->correct_count.has_value());
    EXPECT_EQ(alone->per_token_logprob.empty(), o != v1::TOKEN_OUTPUT_LOGPROB);
    EXPECT_EQ(alone->per_token_entropy.empty(), o != v1::TOKEN_OUTPUT_ENTROPY);
    EXPECT_EQ(alone->per_token_lse.empty(), o != v1::TOKEN_OUTPUT_LSE);
    EXPECT_EQ(alone->per_token_argmax.empty(), o != v1::TOKEN_OUTPUT_ARGMAX);
    if (o == v1::TOKEN_OUTPUT_LOGPROB)
      EXPECT_EQ(alone->per_token_logprob, together->per_token_logprob);
    if (o == v1::TOKEN_OUTPUT_ENTROPY)
      EXPECT_EQ(alone->per_token_entropy, together->per_token_entropy);
    if (o == v1::TOKEN_OUTPUT_LSE) EXPECT_EQ(alone->per_token_lse, together->per_token_lse);
    if (o == v1::TOKEN_OUTPUT_ARGMAX)
      EXPECT_EQ(alone->per_token_argmax, together->per_token_argmax);
  }
  client::Microbatch accuracy = all;
  accuracy.options.clear_token_outputs();
  auto count_only = client_->Step(accuracy);
  ASSERT_TRUE(count_only.ok()) << count_only.status();
  EXPECT_EQ(count_only->correct_count, together->correct_count);
  EXPECT_TRUE(count_only->per_token_argmax.empty());
}

// Outputs larger than one message: chunked after dH and the per-token losses.
TEST_F(TokenOutputsTest, LargeOutputsArriveWholeOverManyMessages) {
  constexpr int64_t n = 3000, d = 8, v = 17;
  auto small = TestServer::Start(size_t{16} << 10);
  ASSERT_TRUE(small.ok()) << small.status();
  auto client = (*small)->NewClient();
  auto head = CreateKnownHead(*client, "chunked", v, d, v1::DTYPE_FP32, 5);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(n, d, v, v1::DTYPE_FP32, 13, 7, kIgnore);
  client::Microbatch mb = ToMicrobatch("chunked", "c", 1, batch);
  mb.options.set_return_per_token_loss(true);
  AskAll(mb);
  auto got = client->Step(mb);
  ASSERT_TRUE(got.ok()) << got.status();
  const RefOutputs want = Distribution(head->weight, batch, d, v);
  ExpectOutputs(*got, want, batch);
}

TEST_F(TokenOutputsTest, ReplayAnswersTheSameOutputsAndOtherOutputsAreAReusedKey) {
  auto head = CreateKnownHead(*client_, "replay", kV, kD, v1::DTYPE_BF16, 6);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_BF16, 14, 4, kIgnore);
  client::Microbatch mb = ToMicrobatch("replay", "r", 1, batch);
  mb.options.add_token_outputs(v1::TOKEN_OUTPUT_ARGMAX);
  mb.options.add_token_outputs(v1::TOKEN_OUTPUT_LOGPROB);
  mb.options.set_return_correct_count(true);
  auto first = client_->Step(mb);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->replayed);

  // The same outputs in another order are the same request.
  client::Microbatch reordered = mb;
  reordered.options.clear_token_outputs();
  reordered.options.add_token_outputs(v1::TOKEN_OUTPUT_LOGPROB);
  reordered.options.add_token_outputs(v1::TOKEN_OUTPUT_ARGMAX);
  for (const client::Microbatch* again : {&mb, &reordered}) {
    auto replay = client_->Step(*again);
    ASSERT_TRUE(replay.ok()) << replay.status();
    EXPECT_TRUE(replay->replayed);
    EXPECT_EQ(replay->loss, first->loss);
    EXPECT_EQ(replay->grad_hidden, first->grad_hidden);
    EXPECT_EQ(replay->per_token_argmax, first->per_token_argmax);
    ASSERT_EQ(replay->per_token_logprob.size(), first->per_token_logprob.size());
    EXPECT_EQ(std::memcmp(replay->per_token_logprob.data(), first->per_token_logprob.data(),
                          first->per_token_logprob.size() * sizeof(float)),
              0);
    EXPECT_EQ(replay->correct_count, first->correct_count);
  }

  client::Microbatch more = mb;
  more.options.add_token_outputs(v1::TOKEN_OUTPUT_ENTROPY);
  client::Microbatch fewer = mb;
  fewer.options.set_return_correct_count(false);
  client::Microbatch none = mb;
  none.options.clear_token_outputs();
  none.options.set_return_correct_count(false);
  for (const client::Microbatch* other : {&more, &fewer, &none}) {
    auto reused = client_->Step(*other);
    EXPECT_EQ(reused.status().code(), absl::StatusCode::kAlreadyExists) << reused.status();
    EXPECT_NE(reused.status().message().find("options"), std::string::npos) << reused.status();
  }
  auto info = client_->GetHead("replay");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), 1u);
}

TEST_F(TokenOutputsTest, BadValuesAreInvalidArgumentAndCountNothing) {
  auto head = CreateKnownHead(*client_, "bad", kV, kD, v1::DTYPE_FP32, 7);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 15);
  struct Case {
    std::vector<int> values;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{0}, "options.token_outputs[0] = TOKEN_OUTPUT_UNSPECIFIED is not a token output"},
      {{1, 99}, "options.token_outputs[1] = 99 is not a token output"},
      {{4, 1, 4}, "options.token_outputs[2] = TOKEN_OUTPUT_ARGMAX repeats an earlier entry"},
  };
  uint64_t sequence = 0;
  for (const Case& c : cases) {
    client::Microbatch mb = ToMicrobatch("bad", "b", ++sequence, batch);
    for (int value : c.values) mb.options.mutable_token_outputs()->Add(value);
    auto got = client_->Step(mb);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    EXPECT_NE(got.status().message().find(c.message), std::string::npos) << got.status();
    // The key was not used up: the same key without the bad field is computed.
    client::Microbatch fixed = mb;
    fixed.options.clear_token_outputs();
    auto retried = client_->Step(fixed);
    ASSERT_TRUE(retried.ok()) << retried.status();
    EXPECT_FALSE(retried->replayed);
  }
  auto info = client_->GetHead("bad");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), cases.size());
}

v1::Placement Placed(v1::PlacementKind kind) {
  v1::Placement placement;
  placement.set_kind(kind);
  placement.set_devices(2);
  return placement;
}

// A replicated head runs each micro-batch whole on one replica: outputs as on one device. A
// sharded head combines its shards' statistics into the same outputs: the reference's, those of a
// one-device head on the same W (the argmax up to near-ties, the rest within fp32 rounding),
// counted once and replayed bit for bit.
TEST(TokenOutputsPlacementTest, ReplicatedAndShardedComputeThemAsOneDevice) {
  server::ServerOptions options = TestServer::Options();
  options.devices = {0, 1};
  auto server = TestServer::StartWith(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->NewClient();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_BF16, 16, 4, kIgnore);

  auto replicated = CreateKnownHead(*client, "replicated", kV, kD, v1::DTYPE_BF16, 8, 0.5,
                                    Placed(v1::PLACEMENT_REPLICATED));
  ASSERT_TRUE(replicated.ok()) << replicated.status();
  const RefOutputs want_replicated = Distribution(replicated->weight, batch, kD, kV);
  for (uint64_t s = 1; s <= 4; ++s) {  // over both replicas
    client::Microbatch mb = ToMicrobatch("replicated", "rep", s, batch);
    AskAll(mb);
    auto got = client->Step(mb);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectOutputs(*got, want_replicated, batch);
  }

  auto one = CreateKnownHead(*client, "one", kV, kD, v1::DTYPE_BF16, 9, 0.5);
  ASSERT_TRUE(one.ok()) << one.status();
  auto sharded = CreateKnownHead(*client, "sharded", kV, kD, v1::DTYPE_BF16, 9, 0.5,
                                 Placed(v1::PLACEMENT_SHARDED));
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  ASSERT_EQ(one->weight, sharded->weight);
  const RefOutputs want = Distribution(sharded->weight, batch, kD, kV);
  uint64_t sequence = 0;
  for (bool forward_only : {false, true}) {
    SCOPED_TRACE(forward_only ? "forward-only" : "counted");
    ++sequence;
    client::Microbatch on_one = ToMicrobatch("one", "shard", sequence, batch);
    on_one.options.set_forward_only(forward_only);
    on_one.options.set_return_per_token_loss(true);
    AskAll(on_one);
    client::Microbatch on_shards = on_one;
    on_shards.head = "sharded";
    auto a = client->Step(on_one);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = client->Step(on_shards);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->forward_only, forward_only);
    ExpectOutputs(*b, want, batch);
    EXPECT_EQ(b->correct_count, a->correct_count);
    EXPECT_EQ(b->token_count, a->token_count);
    for (auto [x, y] : {std::pair{&a->per_token_logprob, &b->per_token_logprob},
                        std::pair{&a->per_token_entropy, &b->per_token_entropy},
                        std::pair{&a->per_token_lse, &b->per_token_lse}}) {
      EXPECT_TRUE(AllClose(*y, std::vector<double>(x->begin(), x->end()), 2e-5));
    }
    for (int64_t t = 0; t < batch.n; ++t) {
      const int32_t x = a->per_token_argmax[t], y = b->per_token_argmax[t];
      if (x == y) continue;
      const std::vector<double>& z = want.logits[t];
      EXPECT_LE(std::abs(z[x] - z[y]), 1e-5 * std::max(1.0, std::abs(z[x]))) << "token " << t;
    }
    // Without the outputs the sharded run is the same bits: asking them changes nothing else.
    client::Microbatch plain = ToMicrobatch("sharded", "plain", sequence, batch);
    plain.options.set_forward_only(forward_only);
    plain.options.set_return_per_token_loss(true);
    auto without = client->Step(plain);
    ASSERT_TRUE(without.ok()) << without.status();
    ExpectSameTraining(*b, *without);
    if (forward_only) continue;
    // Replay answers the sharded outputs bit for bit.
    auto replay = client->Step(on_shards);
    ASSERT_TRUE(replay.ok()) << replay.status();
    EXPECT_TRUE(replay->replayed);
    EXPECT_EQ(replay->per_token_argmax, b->per_token_argmax);
    EXPECT_EQ(replay->correct_count, b->correct_count);
    for (auto [x, y] : {std::pair{&b->per_token_logprob, &replay->per_token_logprob},
                        std::pair{&b->per_token_entropy, &replay->per_token_entropy},
                        std::pair{&b->per_token_lse, &replay->per_token_lse}}) {
      ASSERT_EQ(x->size(), y->size());
      EXPECT_EQ(std::memcmp(x->data(), y->data(), x->size() * sizeof(float)), 0);
    }
  }
  auto info = client->GetHead("sharded");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), 2u);  // the counted one with outputs and without
}

}  // namespace
}  // namespace losshead::testing
