#include "server/engine/idempotency_cache.h"

#include <atomic>
#include <memory>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace losshead::server {
namespace {

std::shared_ptr<const StepOutcome> Outcome(double loss, size_t grad_bytes = 0) {
  auto o = std::make_shared<StepOutcome>();
  o->loss = loss;
  o->grad_hidden.assign(grad_bytes, 'x');
  return o;
}

TEST(IdempotencyCacheTest, FirstClaimsThenReplays) {
  IdempotencyCache cache(4, 1 << 20);
  auto first = cache.Begin("c", 1);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, nullptr);  // claimed
  cache.Complete("c", 1, Outcome(2.5));
  auto again = cache.Begin("c", 1);
  ASSERT_TRUE(again.ok());
  ASSERT_NE(*again, nullptr);
  EXPECT_EQ((*again)->loss, 2.5);
}

TEST(IdempotencyCacheTest, ClientsAreSeparate) {
  IdempotencyCache cache(4, 1 << 20);
  ASSERT_EQ(*cache.Begin("a", 1), nullptr);
  cache.Complete("a", 1, Outcome(1));
  EXPECT_EQ(*cache.Begin("b", 1), nullptr);
}

TEST(IdempotencyCacheTest, EvictedSequenceIsOutsideTheWindow) {
  IdempotencyCache cache(2, 1 << 20);
  for (uint64_t s = 1; s <= 3; ++s) {
    ASSERT_EQ(*cache.Begin("c", s), nullptr);
    cache.Complete("c", s, Outcome(s));
  }
  EXPECT_EQ(cache.remembered("c"), 2u);
  auto old = cache.Begin("c", 1);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(old.status().message().find("outside the replay window"), absl::string_view::npos);
  // Remembered ones still replay; a new, higher sequence is claimed.
  EXPECT_EQ((*cache.Begin("c", 2))->loss, 2);
  EXPECT_EQ(*cache.Begin("c", 4), nullptr);
}

TEST(IdempotencyCacheTest, ByteCapEvictsButKeepsNewest) {
  IdempotencyCache cache(100, 1000);
  ASSERT_EQ(*cache.Begin("c", 1), nullptr);
  cache.Complete("c", 1, Outcome(1, 800));
  ASSERT_EQ(*cache.Begin("c", 2), nullptr);
  cache.Complete("c", 2, Outcome(2, 800));
  EXPECT_EQ(cache.remembered("c"), 1u);
  EXPECT_EQ(cache.Begin("c", 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*cache.Begin("c", 2))->loss, 2);
}

TEST(IdempotencyCacheTest, AbandonedClaimIsRecomputed) {
  IdempotencyCache cache(4, 1 << 20);
  ASSERT_EQ(*cache.Begin("c", 7), nullptr);
  cache.Abandon("c", 7);
  EXPECT_EQ(*cache.Begin("c", 7), nullptr);  // claimed again: failures are not remembered
}

TEST(IdempotencyCacheTest, RepeatWaitsForTheOriginal) {
  IdempotencyCache cache(4, 1 << 20);
  ASSERT_EQ(*cache.Begin("c", 1), nullptr);
  std::atomic<bool> returned{false};
  std::shared_ptr<const StepOutcome> replay;
  std::thread repeat([&] {
    replay = *cache.Begin("c", 1);
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
  ASSERT_EQ(*cache.Begin("c", 1), nullptr);
  std::shared_ptr<const StepOutcome> got = Outcome(-1);
  std::thread repeat([&] { got = *cache.Begin("c", 1); });
  absl::SleepFor(absl::Milliseconds(20));
  cache.Abandon("c", 1);
  repeat.join();
  EXPECT_EQ(got, nullptr);
}

}  // namespace
}  // namespace losshead::server
