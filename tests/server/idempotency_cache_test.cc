#include "server/engine/idempotency_cache.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace losshead::server {
namespace {

std::shared_ptr<StepOutcome> Outcome(double loss, size_t grad_bytes = 0) {
  auto o = std::make_shared<StepOutcome>();
  o->loss = loss;
  o->grad_hidden.assign(grad_bytes, 'x');
  return o;
}

// The fingerprint of a micro-batch of `tokens` tokens whose hidden bytes are `hidden`.
StepFingerprint Fingerprint(absl::string_view hidden = "h", int64_t tokens = 4,
                            absl::string_view targets = "t") {
  v1::StepHeader header;
  header.set_num_tokens(tokens);
  header.set_hidden_dtype(v1::DTYPE_FP32);
  header.set_target_dtype(v1::DTYPE_INT32);
  return StepFingerprint{.hidden = ByteDigest::Of(hidden),
                         .targets = ByteDigest::Of(targets),
                         .shape = StepShape(header)};
}
const StepFingerprint kSame = Fingerprint();

TEST(IdempotencyCacheTest, FirstClaimsThenReplays) {
  IdempotencyCache cache(4, 1 << 20);
  auto first = cache.Begin("c", 1, kSame);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, nullptr);  // claimed
  cache.Complete("c", 1, Outcome(2.5));
  auto again = cache.Begin("c", 1, kSame);
  ASSERT_TRUE(again.ok());
  ASSERT_NE(*again, nullptr);
  EXPECT_EQ((*again)->loss, 2.5);
}

TEST(IdempotencyCacheTest, ClientsAreSeparate) {
  IdempotencyCache cache(4, 1 << 20);
  ASSERT_EQ(*cache.Begin("a", 1, kSame), nullptr);
  cache.Complete("a", 1, Outcome(1));
  EXPECT_EQ(*cache.Begin("b", 1, kSame), nullptr);
}

TEST(IdempotencyCacheTest, EvictedSequenceIsOutsideTheWindow) {
  IdempotencyCache cache(2, 1 << 20);
  for (uint64_t s = 1; s <= 3; ++s) {
    ASSERT_EQ(*cache.Begin("c", s, kSame), nullptr);
    cache.Complete("c", s, Outcome(s));
  }
  EXPECT_EQ(cache.remembered("c"), 2u);
  auto old = cache.Begin("c", 1, kSame);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(old.status().message().find("outside the replay window"), absl::string_view::npos);
  // Remembered ones still replay; a new, higher sequence is claimed.
  EXPECT_EQ((*cache.Begin("c", 2, kSame))->loss, 2);
  EXPECT_EQ(*cache.Begin("c", 4, kSame), nullptr);
}

TEST(IdempotencyCacheTest, ByteCapEvictsButKeepsNewest) {
  IdempotencyCache cache(100, 1000);
  ASSERT_EQ(*cache.Begin("c", 1, kSame), nullptr);
  cache.Complete("c", 1, Outcome(1, 800));
  ASSERT_EQ(*cache.Begin("c", 2, kSame), nullptr);
  cache.Complete("c", 2, Outcome(2, 800));
  EXPECT_EQ(cache.remembered("c"), 1u);
  EXPECT_EQ(cache.Begin("c", 1, kSame).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*cache.Begin("c", 2, kSame))->loss, 2);
}

TEST(IdempotencyCacheTest, AbandonedClaimIsRecomputed) {
  IdempotencyCache cache(4, 1 << 20);
  ASSERT_EQ(*cache.Begin("c", 7, kSame), nullptr);
  cache.Abandon("c", 7);
  EXPECT_EQ(*cache.Begin("c", 7, kSame), nullptr);  // claimed again: failures are not remembered
}

TEST(IdempotencyCacheTest, RepeatWaitsForTheOriginal) {
  IdempotencyCache cache(4, 1 << 20);
  ASSERT_EQ(*cache.Begin("c", 1, kSame), nullptr);
  std::atomic<bool> returned{false};
  std::shared_ptr<const StepOutcome> replay;
  std::thread repeat([&] {
    replay = *cache.Begin("c", 1, kSame);
    returned = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(returned.load());
  cache.Complete("c", 1, Outcome(3));
  repeat.join();
  ASSERT_NE(replay, nullptr);
  EXPECT_EQ(replay->loss, 3);
}

TEST(IdempotencyCacheTest, WaiterClaimsWhenTheOriginalFails) {
  IdempotencyCache cache(4, 1 << 20);
  ASSERT_EQ(*cache.Begin("c", 1, kSame), nullptr);
  std::shared_ptr<const StepOutcome> got = Outcome(-1);
  std::thread repeat([&] { got = *cache.Begin("c", 1, kSame); });
  absl::SleepFor(absl::Milliseconds(20));
  cache.Abandon("c", 1);
  repeat.join();
  EXPECT_EQ(got, nullptr);
}

TEST(IdempotencyCacheTest, ReusedKeyWithOtherContentIsAlreadyExistsAndKeepsTheOriginal) {
  IdempotencyCache cache(4, 1 << 20);
  ASSERT_EQ(*cache.Begin("c", 1, kSame), nullptr);
  cache.Complete("c", 1, Outcome(2.5));
  const struct {
    StepFingerprint fingerprint;
    const char* differs;
  } repeats[] = {{Fingerprint("other hidden"), "hidden"},
                 {Fingerprint("h", 4, "other targets"), "targets"},
                 {Fingerprint("h", 5), "num_tokens"}};
  for (const auto& r : repeats) {
    auto got = cache.Begin("c", 1, r.fingerprint);
    ASSERT_EQ(got.status().code(), absl::StatusCode::kAlreadyExists) << r.differs;
    const std::string message(got.status().message());
    EXPECT_NE(message.find("sequence 1 of client 'c'"), std::string::npos) << message;
    EXPECT_NE(message.find(r.differs), std::string::npos) << message;
  }
  // The remembered outcome is untouched: the same micro-batch still replays it.
  EXPECT_EQ((*cache.Begin("c", 1, kSame))->loss, 2.5);
  EXPECT_EQ(cache.remembered("c"), 1u);
}

TEST(IdempotencyCacheTest, OtherContentDoesNotWaitForAClaimInProgress) {
  IdempotencyCache cache(4, 1 << 20);
  ASSERT_EQ(*cache.Begin("c", 1, kSame), nullptr);
  // Answered at once (a wait would hang this test): the claim holder never completes here.
  EXPECT_EQ(cache.Begin("c", 1, Fingerprint("x")).status().code(),
            absl::StatusCode::kAlreadyExists);
  cache.Abandon("c", 1);
}

TEST(IdempotencyCacheTest, FailedKeyAnswersItsFailureAndIsNeverClaimedAgain) {
  IdempotencyCache cache(4, 1 << 20);
  ASSERT_EQ(*cache.Begin("c", 3, kSame), nullptr);
  cache.Fail("c", 3, absl::DataLossError("counted, results lost"));
  cache.Abandon("c", 3);  // a no-op once failed
  for (int i = 0; i < 2; ++i) {
    auto got = cache.Begin("c", 3, kSame);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_NE(*got, nullptr);
    EXPECT_EQ((*got)->failure.code(), absl::StatusCode::kDataLoss);
  }
  EXPECT_EQ(cache.max_applied("c"), 3u);  // it may be in dW: acknowledged like a result
  EXPECT_EQ(cache.Begin("c", 3, Fingerprint("x")).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(IdempotencyCacheTest, ExportAndImportKeepFingerprintsAndFailures) {
  IdempotencyCache cache(4, 1 << 20);
  ASSERT_EQ(*cache.Begin("c", 1, kSame), nullptr);
  cache.Complete("c", 1, Outcome(1.5));
  ASSERT_EQ(*cache.Begin("c", 2, kSame), nullptr);
  cache.Fail("c", 2, absl::DataLossError("lost"));
  IdempotencyCache restored(4, 1 << 20);
  restored.Import(cache.Export());
  EXPECT_EQ((*restored.Begin("c", 1, kSame))->loss, 1.5);
  EXPECT_EQ((*restored.Begin("c", 2, kSame))->failure.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(restored.Begin("c", 1, Fingerprint("x")).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(IdempotencyCacheTest, ResultWithoutFingerprintReplaysUnchecked) {
  // What a format-2 checkpoint restores: results that predate fingerprints.
  ClientCheckpoint old{.client_id = "c", .max_applied = 1};
  old.results.emplace_back(1, Outcome(4.5));
  IdempotencyCache cache(4, 1 << 20);
  cache.Import({old});
  auto got = cache.Begin("c", 1, Fingerprint("anything"));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)->loss, 4.5);
}

}  // namespace
}  // namespace losshead::server
