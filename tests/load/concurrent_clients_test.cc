// 64 clients stream micro-batches at once for a bounded time while a puller pulls with reset,
// against small server bounds so that many micro-batches are refused and retried. At the end the
// pulled windows add up exactly to what the clients were acknowledged: no micro-batch lost or
// counted twice, and summed dW equals an independent float64 reference summed per micro-batch.
#include <atomic>
#include <cstdio>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/load/load_util.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int kClients = 64;
constexpr int64_t kV = 23, kD = 8;
// Bounded time: each client stops starting new rounds after this; every round still completes.
constexpr absl::Duration kDuration = absl::Seconds(5);

TEST(ConcurrentClientsTest, NoMicrobatchLostOrCountedTwiceUnderBackpressure) {
  auto server = StartServer([](server::ServerOptions& o) {
    o.max_inflight_microbatches = 8;  // far below 64 clients x 2 in flight: refusals happen
    o.max_microbatch_bytes = 4096;
    o.max_inflight_bytes = 4 * 4096;
    o.retry_after = absl::Milliseconds(2);
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  auto admin = Connect(port, FastRetries());
  ASSERT_NE(admin, nullptr);
  auto head = CreateKnownHead(*admin, "load", kV, kD, v1::DTYPE_FP32, 9);
  ASSERT_TRUE(head.ok()) << head.status();

  struct PerClient {
    std::vector<double> dw = std::vector<double>(kV * kD, 0.0);  // reference, summed
    uint64_t tokens = 0, microbatches = 0, replayed = 0, retries = 0;
    absl::Status error;
  };
  std::vector<PerClient> per(kClients);
  std::atomic<int> running{kClients};
  const absl::Time stop = absl::Now() + kDuration;

  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      PerClient& me = per[c];
      auto client = Connect(port, FastRetries());
      uint64_t sequence = 0;
      for (int round = 0; absl::Now() < stop && me.error.ok(); ++round) {
        // Four micro-batches of 3..10 tokens, some targets ignored, pipelined two deep.
        std::vector<HostBatch> batches;
        std::vector<client::Microbatch> mbs;
        for (int i = 0; i < 4; ++i) {
          const int64_t n = 3 + (c * 7 + round * 3 + i) % 8;
          batches.push_back(
              MakeBatch(n, kD, kV, v1::DTYPE_FP32, uint64_t{1000003} * c + 101 * round + i, 2 + i));
        }
        for (int i = 0; i < 4; ++i) {
          mbs.push_back(
              ToMicrobatch(head->name, absl::StrCat("client", c), ++sequence, batches[i]));
        }
        auto answers = client->StepMany(mbs, 2);
        for (int i = 0; i < 4; ++i) {
          if (!answers[i].ok()) {
            me.error = answers[i].status();
            break;
          }
          // Acknowledged: it must be in exactly one pulled window.
          const RefResult r = Reference(head->weight, batches[i].hidden, batches[i].targets,
                                        batches[i].n, kD, kV, {});
          if (answers[i]->token_count != r.token_count) {
            me.error = absl::InternalError("token count differs from the reference");
          }
          me.tokens += answers[i]->token_count;
          me.microbatches += 1;
          me.replayed += answers[i]->replayed;
          for (size_t k = 0; k < me.dw.size(); ++k) me.dw[k] += r.grad_weight[k];
        }
      }
      me.retries = client->retries();
      running.fetch_sub(1);
    });
  }
  std::vector<double> pulled(kV * kD, 0.0);
  uint64_t pulled_tokens = 0, pulled_microbatches = 0, pulls = 0;
  absl::Status pull_error;
  auto add = [&](const client::PulledGradient& g) {
    pulled_tokens += g.summary.token_count();
    pulled_microbatches += g.summary.microbatch_count();
    const std::vector<float> dw = Decode(g.data, v1::DTYPE_FP32);
    for (size_t k = 0; k < dw.size(); ++k) pulled[k] += dw[k];
    ++pulls;
  };
  std::thread puller([&] {
    while (running.load() > 0 && pull_error.ok()) {
      auto g = admin->PullGradient(head->name, v1::DTYPE_FP32, /*reset=*/true);
      if (!g.ok()) {
        pull_error = g.status();
        break;
      }
      add(*g);
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  for (auto& t : threads) t.join();
  puller.join();
  ASSERT_TRUE(pull_error.ok()) << pull_error;
  auto last = admin->PullGradient(head->name, v1::DTYPE_FP32, /*reset=*/true);
  ASSERT_TRUE(last.ok()) << last.status();
  add(*last);

  std::vector<double> want(kV * kD, 0.0);
  uint64_t tokens = 0, microbatches = 0, replayed = 0, retries = 0;
  for (const PerClient& p : per) {
    ASSERT_TRUE(p.error.ok()) << p.error;
    tokens += p.tokens;
    microbatches += p.microbatches;
    replayed += p.replayed;
    retries += p.retries;
    for (size_t k = 0; k < want.size(); ++k) want[k] += p.dw[k];
  }
  EXPECT_EQ(pulled_tokens, tokens);
  EXPECT_EQ(pulled_microbatches, microbatches);
  EXPECT_TRUE(AllClose(std::vector<float>(pulled.begin(), pulled.end()), want, 1e-4));
  auto info = admin->GetHead(head->name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), microbatches);
  EXPECT_EQ(info->tokens_total(), tokens);
  EXPECT_EQ(info->tokens_since_pull(), 0u);
  const v1::Stats stats = WaitForStats(*admin, [](const v1::Stats& s) {
    return s.admitted_microbatches() == 0 && s.reserved_bytes() == 0;
  });
  EXPECT_EQ(stats.admitted_microbatches(), 0u);
  EXPECT_EQ(stats.reserved_bytes(), 0u);
  EXPECT_GT(retries, 0u);  // the small bounds did refuse micro-batches
  // The figures of RELIABILITY.md.
  std::printf(
      "load: %d clients, %.1f s, %llu micro-batches acknowledged, %llu tokens, %llu retries "
      "(refused or lost), %llu replayed, %llu pulls with reset, lost 0, double-counted 0\n",
      kClients, absl::ToDoubleSeconds(kDuration), static_cast<unsigned long long>(microbatches),
      static_cast<unsigned long long>(tokens), static_cast<unsigned long long>(retries),
      static_cast<unsigned long long>(replayed), static_cast<unsigned long long>(pulls));
}

}  // namespace
}  // namespace losshead::testing
