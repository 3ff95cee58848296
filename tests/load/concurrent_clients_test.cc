// 64 clients stream micro-batches at once for a bounded time while a puller pulls with reset,
// against small server bounds so that many micro-batches are refused and retried; in the second
// test, stalled clients meanwhile keep opening streams that send half a micro-batch and then
// nothing, holding admission until --step_stall_timeout lets go of it. At the end the pulled
// windows add up exactly to what the clients were acknowledged: no micro-batch lost or counted
// twice, and summed dW equals an independent float64 reference summed per micro-batch.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
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
constexpr absl::Duration kStall = absl::Milliseconds(250);

struct StallCounts {
  std::atomic<uint64_t> aborted{0};  // stalled micro-batches the server let go of (ABORTED)
  std::atomic<uint64_t> refused{0};  // stalled headers refused at once (no room): held nothing
  std::atomic<uint64_t> other{0};    // anything else: a failure
};

// Until `stop`: opens a Step stream, sends the header and half of a micro-batch that fills the
// byte bound's quarter, then nothing; waits for the server to end the call.
void StallRepeatedly(int port, int id, absl::Time stop, StallCounts& counts) {
  auto stub = v1::LossHead::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  const HostBatch batch = MakeBatch(100, kD, kV, v1::DTYPE_FP32, 77 + id);  // 3.2 KB of hidden
  for (uint64_t sequence = 1; absl::Now() < stop; ++sequence) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto stream = stub->Step(&context);
    const auto messages =
        StepMessages(ToMicrobatch("load", absl::StrCat("stalled", id), sequence, batch), 2);
    if (!stream->Write(messages[0])) {
      counts.other.fetch_add(1);
      continue;
    }
    v1::StepResponse response;
    if (stream->Read(&response)) {
      // Answered at once: refused for want of room, holding nothing. Try again shortly.
      (response.has_error() ? counts.refused : counts.other).fetch_add(1);
      context.TryCancel();
      while (stream->Read(&response)) {
      }
      stream->Finish();
      absl::SleepFor(absl::Milliseconds(5));
      continue;
    }
    const grpc::Status status = stream->Finish();
    (status.error_code() == grpc::StatusCode::ABORTED ? counts.aborted : counts.other)
        .fetch_add(1);
  }
}

void RunLoad(int stalled_clients) {
  auto server = StartServer([](server::ServerOptions& o) {
    o.max_inflight_microbatches = 8;  // far below 64 clients x 2 in flight: refusals happen
    o.max_microbatch_bytes = 4096;
    o.max_inflight_bytes = 4 * 4096;
    o.retry_after = absl::Milliseconds(2);
    o.step_stall_timeout = kStall;
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

  StallCounts stalls;
  std::vector<std::thread> stallers;
  for (int i = 0; i < stalled_clients; ++i) {
    stallers.emplace_back([&, i] { StallRepeatedly(port, i, stop, stalls); });
  }
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
  for (auto& t : stallers) t.join();
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
  EXPECT_EQ(stalls.other.load(), 0u);
  if (stalled_clients > 0) {
    EXPECT_GT(stalls.aborted.load(), 0u);  // stalled micro-batches did hold room, and let go
    EXPECT_GT(microbatches, 0u);
  }
  // The figures of RELIABILITY.md.
  std::printf(
      "load: %d clients + %d stalled, %.1f s, %llu micro-batches acknowledged, %llu tokens, "
      "%llu retries (refused or lost), %llu replayed, %llu pulls with reset, %llu stalled "
      "micro-batches abandoned after %.2f s, %llu stalled headers refused at once, lost 0, "
      "double-counted 0\n",
      kClients, stalled_clients, absl::ToDoubleSeconds(kDuration),
      static_cast<unsigned long long>(microbatches), static_cast<unsigned long long>(tokens),
      static_cast<unsigned long long>(retries), static_cast<unsigned long long>(replayed),
      static_cast<unsigned long long>(pulls),
      static_cast<unsigned long long>(stalls.aborted.load()), absl::ToDoubleSeconds(kStall),
      static_cast<unsigned long long>(stalls.refused.load()));
}

TEST(ConcurrentClientsTest, NoMicrobatchLostOrCountedTwiceUnderBackpressure) { RunLoad(0); }

// Four stalled clients can each hold a quarter of the byte bound: while they all stall, nothing
// else is admitted, and only the stall timeout lets the others go on.
TEST(ConcurrentClientsTest, StalledClientsDelayButNeverLoseWellBehavedOnes) { RunLoad(4); }

}  // namespace
}  // namespace losshead::testing
