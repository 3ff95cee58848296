// Remembered results are bounded server-wide: many client ids, one micro-batch each (a trainer
// fleet, or a client that makes up a new id per call), keep at most --idempotency_total_bytes of
// results over every head, checkpoints hold only those, results older than --idempotency_ttl go
// even from an idle server, and a repeat of an evicted one is FAILED_PRECONDITION naming the
// eviction, never computed again. Evictions are counted by cause.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

// The probe's head: V = 64, D = 256, fp32; 64-token micro-batches, 64 KiB of dH each.
constexpr int64_t kV = 64, kD = 256, kN = 64;
constexpr size_t kResultBytes = kN * kD * sizeof(float);
constexpr size_t kBudget = size_t{1} << 20;  // room for about 15 results
constexpr int kClients = 64;

class RememberedResultsTest : public ::testing::Test {
 protected:
  void Start(const std::function<void(server::ServerOptions&)>& adjust) {
    server::ServerOptions options = TestServer::Options(kTestServerMessageBytes, /*metrics=*/true);
    adjust(options);
    auto s = TestServer::StartWith(options);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    client_ = server_->NewClient();
    ASSERT_NE(client_, nullptr);
  }

  double Scrape(const std::string& name, const std::map<std::string, std::string>& labels = {}) {
    return ScrapeSum(server_->metrics_port(), name, labels);
  }

  // The head's counters and dW, to tell that a refused repeat counted nothing.
  struct Counted {
    uint64_t microbatches = 0;
    uint64_t tokens = 0;
    client::Bytes gradient;
    bool operator==(const Counted&) const = default;
  };
  Counted Now(const std::string& head) {
    Counted c;
    auto info = client_->GetHead(head);
    auto pulled = client_->PullGradient(head, v1::DTYPE_FP32, false);
    EXPECT_TRUE(info.ok() && pulled.ok());
    if (info.ok()) {
      c.microbatches = info->microbatches_total();
      c.tokens = info->tokens_total();
    }
    if (pulled.ok()) c.gradient = pulled->data;
    return c;
  }

  std::unique_ptr<TestServer> server_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(RememberedResultsTest,
       DistinctClientIdsKeepAtMostTheServerBudgetAndEvictedRepeatsCountNothing) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/remembered_results_checkpoints.", getpid());
  std::filesystem::remove_all(dir);
  Start([&](server::ServerOptions& o) {
    o.idempotency_total_bytes = kBudget;
    o.checkpoint_dir = dir;
    o.checkpoint_interval = absl::ZeroDuration();
  });
  // Two heads share the budget.
  std::vector<KnownHead> heads;
  for (const char* name : {"first", "second"}) {
    auto head = CreateKnownHead(*client_, name, kV, kD, v1::DTYPE_FP32, heads.size() + 1);
    ASSERT_TRUE(head.ok()) << head.status();
    heads.push_back(*head);
  }
  std::vector<HostBatch> batches;
  for (int i = 0; i < kClients; ++i) {
    batches.push_back(MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 100 + i));
    const KnownHead& head = heads[i % 2];
    auto got = client_->Step(ToMicrobatch(head.name, absl::StrCat("client-", i), 1, batches[i]));
    ASSERT_TRUE(got.ok()) << i << ": " << got.status();
    const RefResult want =
        Reference(head.weight, batches[i].hidden, batches[i].targets, kN, kD, kV, {});
    const Tolerance tol = ToleranceFor(v1::DTYPE_FP32);
    ASSERT_NEAR(got->loss, want.loss, tol.loss_rel * std::max(1.0, std::fabs(want.loss))) << i;
    ASSERT_TRUE(AllClose(Decode(got->grad_hidden, v1::DTYPE_FP32), want.grad_hidden, tol.grad));
  }

  // At most the budget (plus the result remembered last) over both heads; the rest evicted for
  // the server's bytes, none for the per-client bounds.
  const double bytes = Scrape("losshead_idempotency_bytes");
  const double results = Scrape("losshead_idempotency_results");
  EXPECT_LE(bytes, kBudget + kResultBytes + 4096);
  EXPECT_GE(bytes, kBudget / 2);
  EXPECT_LE(results, kBudget / kResultBytes + 1);
  EXPECT_GE(results, 8);
  EXPECT_EQ(Scrape("losshead_idempotency_evictions_total", {{"cause", "server_bytes"}}),
            kClients - results);
  EXPECT_EQ(Scrape("losshead_idempotency_evictions_total", {{"cause", "window"}}), 0);
  EXPECT_EQ(Scrape("losshead_idempotency_evictions_total", {{"cause", "client_bytes"}}), 0);

  // The oldest client's repeat is refused, naming the eviction; nothing is counted again.
  const Counted before = Now(heads[0].name);
  EXPECT_EQ(before.microbatches, static_cast<uint64_t>(kClients / 2));
  auto evicted = client_->Step(ToMicrobatch(heads[0].name, "client-0", 1, batches[0]));
  ASSERT_EQ(evicted.status().code(), absl::StatusCode::kFailedPrecondition) << evicted.status();
  EXPECT_NE(evicted.status().message().find("--idempotency_total_bytes"), absl::string_view::npos)
      << evicted.status();
  EXPECT_NE(evicted.status().message().find("client 'client-0'"), absl::string_view::npos)
      << evicted.status();
  EXPECT_TRUE(Now(heads[0].name) == before);
  // The newest one replays.
  const int last = kClients - 1;
  auto replayed = client_->Step(
      ToMicrobatch(heads[last % 2].name, absl::StrCat("client-", last), 1, batches[last]));
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_TRUE(replayed->replayed);

  // Checkpoints hold only what is remembered: W and dW of both heads and at most the budget.
  auto checkpoint = client_->Checkpoint();
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  uint64_t written = 0;
  for (const v1::HeadCheckpoint& h : checkpoint->heads()) written += h.bytes();
  const size_t tensors = 2 * 2 * kV * kD * sizeof(float);
  EXPECT_LE(written, tensors + kBudget + kResultBytes + (64 << 10)) << written;
  server_.reset();
  std::filesystem::remove_all(dir);
}

TEST_F(RememberedResultsTest, ResultsOlderThanTheTtlAreEvictedEvenFromAnIdleServer) {
  Start([](server::ServerOptions& o) { o.idempotency_ttl = absl::Milliseconds(500); });
  auto head = CreateKnownHead(*client_, "aged", kV, kD, v1::DTYPE_FP32, 7);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 8);
  ASSERT_TRUE(client_->Step(ToMicrobatch(head->name, "aged", 1, batch)).ok());
  auto again = client_->Step(ToMicrobatch(head->name, "aged", 1, batch));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->replayed);
  absl::SleepFor(absl::Milliseconds(700));
  const Counted before = Now(head->name);
  auto old = client_->Step(ToMicrobatch(head->name, "aged", 1, batch));
  ASSERT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition) << old.status();
  EXPECT_NE(old.status().message().find("(--idempotency_ttl)"), absl::string_view::npos)
      << old.status();
  EXPECT_TRUE(Now(head->name) == before);
  EXPECT_EQ(Scrape("losshead_idempotency_evictions_total", {{"cause", "age"}}), 1);

  // Another result, then no call at all: the server lets it go on its own.
  ASSERT_TRUE(client_->Step(ToMicrobatch(head->name, "aged", 2, batch)).ok());
  double left = 1;
  for (absl::Time until = absl::Now() + absl::Seconds(5); left != 0 && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(50));
    left = Scrape("losshead_idempotency_results");
  }
  EXPECT_EQ(left, 0);
  EXPECT_EQ(Scrape("losshead_idempotency_bytes"), 0);
  EXPECT_EQ(Scrape("losshead_idempotency_evictions_total", {{"cause", "age"}}), 2);
  // The client's progress stays acknowledged.
  auto progress = client_->GetClientProgress(head->name, "aged");
  ASSERT_TRUE(progress.ok()) << progress.status();
  EXPECT_EQ(progress->acknowledged_sequence(), 2u);
}

}  // namespace
}  // namespace losshead::testing
