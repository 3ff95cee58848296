// The server-wide budget of remembered results: bytes over every head and client id, age, the
// evictions by cause, and that an evicted key is refused (never claimed again) whatever evicted it.
#include "server/engine/idempotency_budget.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/engine/idempotency_cache.h"

namespace losshead::server {
namespace {

using Cause = IdempotencyBudget::Cause;

constexpr size_t kGradBytes = 1000;

std::shared_ptr<StepOutcome> Outcome(double loss, size_t grad_bytes = kGradBytes) {
  auto o = std::make_shared<StepOutcome>();
  o->loss = loss;
  o->grad_hidden.assign(grad_bytes, 'x');
  return o;
}

StepFingerprint Fingerprint() {
  v1::StepHeader header;
  header.set_num_tokens(4);
  header.set_hidden_dtype(v1::DTYPE_FP32);
  header.set_target_dtype(v1::DTYPE_INT32);
  return StepFingerprint{
      .hidden = ByteDigest::Of("h"), .targets = ByteDigest::Of("t"), .shape = StepShape(header)};
}
const StepFingerprint kSame = Fingerprint();

// What one remembered result of Outcome(...) counts (its dH and its bookkeeping).
size_t OneResult() {
  StepOutcome o = *Outcome(0);
  o.fingerprint = kSame;
  return o.bytes();
}

// Claims and completes (client_id, sequence) with loss `loss`.
void Remember(IdempotencyCache& cache, const std::string& client_id, uint64_t sequence,
              double loss) {
  auto claim = cache.Begin(client_id, sequence, kSame);
  ASSERT_TRUE(claim.ok()) << claim.status();
  ASSERT_EQ(*claim, nullptr) << client_id << " " << sequence << " was not a new key";
  cache.Complete(client_id, sequence, Outcome(loss));
}

uint64_t Evictions(const IdempotencyBudget& budget, Cause cause) {
  return budget.usage().evictions[static_cast<size_t>(cause)];
}

// A clock that tests move by hand.
class FakeClock {
 public:
  absl::Time Now() {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }
  std::function<absl::Time()> AsFunction() {
    return [this] { return Now(); };
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
};

TEST(IdempotencyBudgetTest, ServerBytesEvictTheOldestResultsOfEveryHeadAndClient) {
  // Room for three results server-wide; each head and client id alone is far below its own caps,
  // as the distinct client ids of many trainers (or of a careless one) would be.
  auto budget = std::make_shared<IdempotencyBudget>(
      IdempotencyBudget::Limits{.total_bytes = 3 * OneResult()});
  IdempotencyCache a(64, 1 << 20, budget);
  IdempotencyCache b(64, 1 << 20, budget);
  for (int i = 0; i < 8; ++i) {
    Remember(i % 2 == 0 ? a : b, absl::StrCat("client-", i), 1, i);
    const IdempotencyBudget::Usage usage = budget->usage();
    EXPECT_LE(usage.bytes, 3 * OneResult()) << i;
    EXPECT_EQ(usage.results, std::min(i + 1, 3)) << i;
  }
  EXPECT_EQ(Evictions(*budget, Cause::kServerBytes), 5u);
  EXPECT_EQ(Evictions(*budget, Cause::kWindow), 0u);
  // The newest three replay, one head's and the other's alike.
  EXPECT_EQ((*a.Begin("client-6", 1, kSame))->loss, 6);
  EXPECT_EQ((*b.Begin("client-7", 1, kSame))->loss, 7);
  EXPECT_EQ((*b.Begin("client-5", 1, kSame))->loss, 5);
  // An evicted one is refused, naming the eviction, and is not claimed: it is never recomputed.
  for (int i = 0; i < 5; ++i) {
    IdempotencyCache& cache = i % 2 == 0 ? a : b;
    auto again = cache.Begin(absl::StrCat("client-", i), 1, kSame);
    ASSERT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << i;
    const std::string message(again.status().message());
    EXPECT_NE(message.find("--idempotency_total_bytes"), std::string::npos) << message;
    EXPECT_NE(message.find("no longer remembered"), std::string::npos) << message;
    EXPECT_EQ(cache.max_applied(absl::StrCat("client-", i)), 1u);  // still acknowledged
  }
  EXPECT_EQ(budget->usage().results, 3u);
  // A new sequence of an evicted client is computed as usual.
  EXPECT_EQ(*a.Begin("client-0", 2, kSame), nullptr);
  a.Abandon("client-0", 2);
}

TEST(IdempotencyBudgetTest, TheResultJustRememberedIsKeptEvenAboveTheBudget) {
  auto budget = std::make_shared<IdempotencyBudget>(IdempotencyBudget::Limits{.total_bytes = 1});
  IdempotencyCache cache(64, 1 << 20, budget);
  Remember(cache, "c", 1, 1);
  EXPECT_EQ((*cache.Begin("c", 1, kSame))->loss, 1);  // its answer can be asked for again
  Remember(cache, "d", 1, 2);
  EXPECT_EQ(budget->usage().results, 1u);
  EXPECT_EQ(cache.Begin("c", 1, kSame).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*cache.Begin("d", 1, kSame))->loss, 2);
}

TEST(IdempotencyBudgetTest, ResultsOlderThanTheTtlAreEvictedAndRefused) {
  FakeClock clock;
  auto budget = std::make_shared<IdempotencyBudget>(
      IdempotencyBudget::Limits{.ttl = absl::Minutes(10)}, clock.AsFunction());
  IdempotencyCache cache(64, 1 << 20, budget);
  Remember(cache, "c", 1, 1);
  clock.Advance(absl::Minutes(6));
  Remember(cache, "c", 2, 2);
  clock.Advance(absl::Minutes(5));  // 11 min after the first, 5 after the second
  auto old = cache.Begin("c", 1, kSame);
  ASSERT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string message(old.status().message());
  EXPECT_NE(message.find("older than 10m (--idempotency_ttl)"), std::string::npos) << message;
  EXPECT_EQ((*cache.Begin("c", 2, kSame))->loss, 2);
  EXPECT_EQ(Evictions(*budget, Cause::kAge), 1u);
  // Expire lets the rest go without any call on the cache (an idle server).
  clock.Advance(absl::Minutes(6));
  budget->Expire();
  EXPECT_EQ(budget->usage().results, 0u);
  EXPECT_EQ(budget->usage().bytes, 0u);
  EXPECT_EQ(Evictions(*budget, Cause::kAge), 2u);
  EXPECT_EQ(cache.Begin("c", 2, kSame).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.max_applied("c"), 2u);
}

TEST(IdempotencyBudgetTest, ACheckpointHoldsOnlyWhatIsRemembered) {
  FakeClock clock;
  auto budget = std::make_shared<IdempotencyBudget>(
      IdempotencyBudget::Limits{.total_bytes = 4 * OneResult(), .ttl = absl::Hours(1)},
      clock.AsFunction());
  IdempotencyCache cache(64, 1 << 20, budget);
  for (uint64_t s = 1; s <= 10; ++s) Remember(cache, absl::StrCat("c", s % 3), s, s);
  std::vector<ClientCheckpoint> exported = cache.Export();
  size_t results = 0;
  for (const ClientCheckpoint& c : exported) results += c.results.size();
  EXPECT_EQ(results, 4u);
  clock.Advance(absl::Hours(2));
  exported = cache.Export();  // expired results are evicted before the cut
  results = 0;
  for (const ClientCheckpoint& c : exported) {
    results += c.results.size();
    EXPECT_TRUE(c.max_evicted.has_value()) << c.client_id;  // the floors stay
  }
  EXPECT_EQ(results, 0u);
  EXPECT_EQ(exported.size(), 3u);
}

TEST(IdempotencyBudgetTest, ImportAppliesTheBudgetAndARestoredFloorIsRefused) {
  IdempotencyCache original(64, 1 << 20);
  for (uint64_t s = 1; s <= 6; ++s) Remember(original, "c", s, s);
  std::vector<ClientCheckpoint> saved = original.Export();
  saved[0].max_evicted = 0;  // as if sequence 0 had been evicted before the checkpoint
  auto budget = std::make_shared<IdempotencyBudget>(
      IdempotencyBudget::Limits{.total_bytes = 2 * OneResult()});
  IdempotencyCache restored(64, 1 << 20, budget);
  restored.Import(saved);
  EXPECT_EQ(budget->usage().results, 2u);
  EXPECT_EQ(Evictions(*budget, Cause::kServerBytes), 4u);
  EXPECT_EQ((*restored.Begin("c", 6, kSame))->loss, 6);
  auto evicted = restored.Begin("c", 3, kSame);
  ASSERT_EQ(evicted.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(evicted.status().message().find("--idempotency_total_bytes"), absl::string_view::npos)
      << evicted.status();
  auto before = restored.Begin("c", 0, kSame);
  ASSERT_EQ(before.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(before.status().message().find("before the server's last restart"),
            absl::string_view::npos)
      << before.status();
}

TEST(IdempotencyBudgetTest, EachCauseIsCountedAndNamed) {
  auto budget = std::make_shared<IdempotencyBudget>(IdempotencyBudget::Limits());
  IdempotencyCache windowed(2, 1 << 20, budget);
  IdempotencyCache capped(64, 2 * OneResult(), budget);
  for (uint64_t s = 1; s <= 4; ++s) {
    Remember(windowed, "w", s, s);
    Remember(capped, "b", s, s);
  }
  EXPECT_EQ(Evictions(*budget, Cause::kWindow), 2u);
  EXPECT_EQ(Evictions(*budget, Cause::kClientBytes), 2u);
  EXPECT_EQ(budget->usage().results, 4u);
  EXPECT_NE(windowed.Begin("w", 1, kSame).status().message().find("outside the replay window"),
            absl::string_view::npos);
  EXPECT_NE(capped.Begin("b", 2, kSame).status().message().find("--idempotency_max_bytes"),
            absl::string_view::npos);
  EXPECT_EQ(IdempotencyBudget::CauseName(Cause::kServerBytes), "server_bytes");
}

TEST(IdempotencyBudgetTest, ADeletedHeadGivesItsBytesBackWithoutCountingEvictions) {
  auto budget = std::make_shared<IdempotencyBudget>(IdempotencyBudget::Limits());
  {
    IdempotencyCache cache(64, 1 << 20, budget);
    for (uint64_t s = 1; s <= 3; ++s) Remember(cache, "c", s, s);
    EXPECT_EQ(budget->usage().results, 3u);
  }
  const IdempotencyBudget::Usage usage = budget->usage();
  EXPECT_EQ(usage.results, 0u);
  EXPECT_EQ(usage.bytes, 0u);
  for (uint64_t n : usage.evictions) EXPECT_EQ(n, 0u);
}

TEST(IdempotencyBudgetTest, ManyStreamsOverSeveralHeadsStayWithinTheBudget) {
  // Four heads, eight threads, each its own client ids: whatever the interleaving, the bytes stay
  // within the budget (plus the one result just remembered), and every key is either replayed or
  // refused, never claimed a second time.
  constexpr size_t kResults = 16;
  auto budget = std::make_shared<IdempotencyBudget>(
      IdempotencyBudget::Limits{.total_bytes = kResults * OneResult()});
  std::vector<std::unique_ptr<IdempotencyCache>> heads;
  for (int h = 0; h < 4; ++h) {
    heads.push_back(std::make_unique<IdempotencyCache>(8, 1 << 20, budget));
  }
  std::atomic<bool> over{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t s = 1; s <= 200; ++s) {
        IdempotencyCache& cache = *heads[(t + s) % heads.size()];
        const std::string id = absl::StrCat("t", t, "-", s % 5);
        auto claim = cache.Begin(id, s, kSame);
        if (!claim.ok() || *claim != nullptr) {
          over = true;  // every (id, s) is new
          continue;
        }
        cache.Complete(id, s, Outcome(s));
        if (budget->usage().bytes > (kResults + 8) * OneResult()) over = true;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_FALSE(over.load());
  EXPECT_LE(budget->usage().bytes, kResults * OneResult());
  for (int t = 0; t < 8; ++t) {
    for (uint64_t s = 1; s <= 200; ++s) {
      IdempotencyCache& cache = *heads[(t + s) % heads.size()];
      auto again = cache.Begin(absl::StrCat("t", t, "-", s % 5), s, kSame);
      if (again.ok()) {
        ASSERT_NE(*again, nullptr) << t << " " << s;  // a replay, never a new claim
        EXPECT_EQ((*again)->loss, s);
      } else {
        EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
      }
    }
  }
}

}  // namespace
}  // namespace losshead::server
