// Gradient accounting: pulls with reset while others step lose nothing and count nothing twice;
// idempotent retries return the first answer and add nothing.
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

class AccountingTest : public SharedServerTest<> {};

TEST_F(AccountingTest, PullOnEmptyAccumulatorIsOkWithZeroTokens) {
  auto head = CreateKnownHead(*client_, "empty", 11, 5, v1::DTYPE_BF16, 1);
  ASSERT_TRUE(head.ok()) << head.status();
  for (bool reset : {false, true}) {
    auto pulled = client_->PullGradient(head->name, v1::DTYPE_FP32, reset);
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    EXPECT_EQ(pulled->summary.token_count(), 0u);
    EXPECT_EQ(pulled->summary.microbatch_count(), 0u);
    EXPECT_EQ(pulled->summary.min_weights_version(), 0u);
    EXPECT_EQ(pulled->summary.max_weights_version(), 0u);
    EXPECT_EQ(pulled->summary.was_reset(), reset);
    ASSERT_EQ(pulled->data.size(), 11u * 5u * 4u);
    for (float x : Decode(pulled->data, v1::DTYPE_FP32)) ASSERT_EQ(x, 0.0f);
  }
}

TEST_F(AccountingTest, PullWithoutResetKeepsAndResetClears) {
  auto head = CreateKnownHead(*client_, "keep", 31, 8, v1::DTYPE_FP32, 2);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(9, 8, 31, v1::DTYPE_FP32, 3);
  ASSERT_TRUE(client_->Step(ToMicrobatch(head->name, "k", 1, batch)).ok());
  auto first = client_->PullGradient(head->name, v1::DTYPE_FP32, false);
  auto second = client_->PullGradient(head->name, v1::DTYPE_FP32, true);
  auto third = client_->PullGradient(head->name, v1::DTYPE_FP32, false);
  ASSERT_TRUE(first.ok() && second.ok() && third.ok());
  EXPECT_EQ(first->summary.token_count(), 9u);
  EXPECT_FALSE(first->summary.was_reset());
  EXPECT_EQ(first->data, second->data);
  EXPECT_EQ(second->summary.token_count(), 9u);
  EXPECT_EQ(third->summary.token_count(), 0u);
  auto info = client_->GetHead(head->name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens_since_pull(), 0u);
  EXPECT_EQ(info->tokens_total(), 9u);
  EXPECT_EQ(info->microbatches_total(), 1u);
}

TEST_F(AccountingTest, PullsWithResetWhileOthersStepLoseNothingAndCountNothingTwice) {
  constexpr int kSteppers = 3, kPerStepper = 8;
  constexpr int64_t n = 24, d = 16, v = 53;
  auto head = CreateKnownHead(*client_, "racing", v, d, v1::DTYPE_FP32, 4);
  ASSERT_TRUE(head.ok()) << head.status();

  std::vector<double> want_dw(v * d, 0.0);
  uint64_t want_tokens = 0;
  std::vector<std::vector<HostBatch>> batches(kSteppers);
  for (int s = 0; s < kSteppers; ++s) {
    for (int i = 0; i < kPerStepper; ++i) {
      // Varying ignore patterns make token counts differ per micro-batch.
      batches[s].push_back(MakeBatch(n, d, v, v1::DTYPE_FP32, 500 + 17 * s + i, 2 + (i % 4)));
      const RefResult r =
          Reference(head->weight, batches[s][i].hidden, batches[s][i].targets, n, d, v, {});
      want_tokens += r.token_count;
      for (size_t k = 0; k < want_dw.size(); ++k) want_dw[k] += r.grad_weight[k];
    }
  }

  std::atomic<int> running{kSteppers};
  std::vector<absl::Status> statuses(kSteppers + 1);
  std::vector<double> pulled_dw(v * d, 0.0);
  uint64_t pulled_tokens = 0, pulled_microbatches = 0;
  int pulls = 0;
  auto add_pull = [&](const client::PulledGradient& g) {
    pulled_tokens += g.summary.token_count();
    pulled_microbatches += g.summary.microbatch_count();
    const std::vector<float> dw = Decode(g.data, v1::DTYPE_FP32);
    for (size_t k = 0; k < dw.size(); ++k) pulled_dw[k] += dw[k];
    ++pulls;
  };

  std::vector<std::thread> threads;
  for (int s = 0; s < kSteppers; ++s) {
    threads.emplace_back([&, s] {
      auto client = server_->NewClient();
      auto stream = client->OpenStepStream();
      for (int i = 0; i < kPerStepper && stream.ok(); ++i) {
        // Two in flight at a time: pulls interleave with pipelined work.
        absl::Status sent = (*stream)->Send(
            ToMicrobatch(head->name, absl::StrCat("stepper", s), i + 1, batches[s][i]));
        if (!sent.ok()) statuses[s] = sent;
        if ((*stream)->outstanding() >= 2) {
          auto got = (*stream)->Receive();
          if (!got.ok()) statuses[s] = got.status();
        }
      }
      while (stream.ok() && (*stream)->outstanding() > 0) {
        auto got = (*stream)->Receive();
        if (!got.ok()) statuses[s] = got.status();
      }
      if (stream.ok() && statuses[s].ok()) statuses[s] = (*stream)->Finish();
      running.fetch_sub(1);
    });
  }
  threads.emplace_back([&] {
    auto client = server_->NewClient();
    while (running.load() > 0) {
      auto g = client->PullGradient(head->name, v1::DTYPE_FP32, /*reset=*/true);
      if (!g.ok()) {
        statuses[kSteppers] = g.status();
        return;
      }
      add_pull(*g);
    }
  });
  for (auto& t : threads) t.join();
  for (const absl::Status& s : statuses) ASSERT_TRUE(s.ok()) << s;

  auto last = client_->PullGradient(head->name, v1::DTYPE_FP32, true);
  ASSERT_TRUE(last.ok()) << last.status();
  add_pull(*last);
  std::printf("%d pulls covered %llu micro-batches\n", pulls,
              static_cast<unsigned long long>(pulled_microbatches));
  EXPECT_EQ(pulled_tokens, want_tokens);
  EXPECT_EQ(pulled_microbatches, static_cast<uint64_t>(kSteppers * kPerStepper));
  std::vector<float> pulled_f(pulled_dw.begin(), pulled_dw.end());
  EXPECT_TRUE(AllClose(pulled_f, want_dw, 1e-4));

  auto info = client_->GetHead(head->name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens_total(), want_tokens);
  EXPECT_EQ(info->microbatches_total(), static_cast<uint64_t>(kSteppers * kPerStepper));
  EXPECT_EQ(info->tokens_since_pull(), 0u);
}

TEST_F(AccountingTest, RetriedMicrobatchReplaysSameAnswerWithoutAccumulating) {
  constexpr int64_t n = 29, d = 12, v = 41;
  auto head = CreateKnownHead(*client_, "retry", v, d, v1::DTYPE_BF16, 5);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(n, d, v, v1::DTYPE_BF16, 6, 4);
  client::Microbatch mb = ToMicrobatch(head->name, "trainer-0", 42, batch);
  mb.options.set_return_per_token_loss(true);

  auto first = client_->Step(mb);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->replayed);
  auto after_first = client_->PullGradient(head->name, v1::DTYPE_FP32, false);
  auto info_first = client_->GetHead(head->name);
  ASSERT_TRUE(after_first.ok() && info_first.ok());

  // The retry: on a new stream (as after a broken connection) and again on a shared stream.
  auto retry = client_->Step(mb);
  ASSERT_TRUE(retry.ok()) << retry.status();
  auto stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*stream)->Send(mb).ok());
  ASSERT_TRUE((*stream)->Send(mb).ok());
  auto again1 = (*stream)->Receive();
  auto again2 = (*stream)->Receive();
  EXPECT_TRUE((*stream)->Finish().ok());
  for (const auto* r : {&retry, &again1, &again2}) {
    ASSERT_TRUE(r->ok()) << r->status();
    EXPECT_TRUE((*r)->replayed);
    EXPECT_EQ((*r)->loss, first->loss);
    EXPECT_EQ((*r)->loss_sum, first->loss_sum);
    EXPECT_EQ((*r)->token_count, first->token_count);
    EXPECT_EQ((*r)->weights_version, first->weights_version);
    EXPECT_EQ((*r)->grad_hidden, first->grad_hidden);
    EXPECT_EQ((*r)->per_token_loss, first->per_token_loss);
  }

  auto after = client_->PullGradient(head->name, v1::DTYPE_FP32, false);
  auto info = client_->GetHead(head->name);
  ASSERT_TRUE(after.ok() && info.ok());
  EXPECT_EQ(after->data, after_first->data);
  EXPECT_EQ(after->summary.token_count(), after_first->summary.token_count());
  EXPECT_EQ(after->summary.microbatch_count(), 1u);
  EXPECT_EQ(info->tokens_total(), info_first->tokens_total());
  EXPECT_EQ(info->microbatches_total(), 1u);

  // Another sequence number from the same client is new work.
  mb.sequence = 43;
  auto next = client_->Step(mb);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_FALSE(next->replayed);
  auto final_info = client_->GetHead(head->name);
  ASSERT_TRUE(final_info.ok());
  EXPECT_EQ(final_info->microbatches_since_pull(), 2u);
}

}  // namespace
}  // namespace losshead::testing
