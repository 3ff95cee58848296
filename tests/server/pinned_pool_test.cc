// PinnedPool against an allocator on the heap that counts its calls: recycling, fit, the idle
// bound, and the backends that have no page-locked memory.
#include "server/engine/pinned_pool.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace losshead::server {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

struct CountingAllocator {
  int calls = 0;
  absl::Status fail;  // returned instead of memory when not OK
  PinnedPool::Allocate Fn() {
    return [this](size_t bytes) -> absl::StatusOr<kernels::HostBuffer> {
      ++calls;
      if (!fail.ok()) return fail;
      return kernels::HostBuffer(std::malloc(bytes), bytes, &std::free);
    };
  }
};

TEST(PinnedPoolTest, BuffersAreRoundedToWholeMiBFilledInOrderAndRecycled) {
  CountingAllocator alloc;
  auto pool = PinnedPool::Create(alloc.Fn(), 64 * kMiB);
  PinnedBytes a = pool->Take(3 * kMiB + 5);
  ASSERT_TRUE(a);
  EXPECT_EQ(a.capacity(), 4 * kMiB);
  EXPECT_EQ(a.size(), 0u);
  ASSERT_TRUE(a.Append("abc"));
  ASSERT_TRUE(a.Append("de"));
  EXPECT_EQ(a.view(), "abcde");
  EXPECT_EQ(pool->held_bytes(), 4 * kMiB);
  const char* memory = a.view().data();
  a.Reset();
  EXPECT_FALSE(a);
  EXPECT_EQ(pool->idle_bytes(), 4 * kMiB);
  // The same memory comes back, empty, without a new allocation.
  PinnedBytes b = pool->Take(3 * kMiB);
  ASSERT_TRUE(b);
  EXPECT_EQ(b.view().data(), memory);
  EXPECT_EQ(b.size(), 0u);
  EXPECT_EQ(alloc.calls, 1);
  EXPECT_EQ(pool->idle_bytes(), 0u);
}

TEST(PinnedPoolTest, AppendBeyondTheCapacityAppendsNothing) {
  CountingAllocator alloc;
  auto pool = PinnedPool::Create(alloc.Fn(), 64 * kMiB);
  PinnedBytes a = pool->Take(1);
  ASSERT_TRUE(a.Append(std::string(kMiB - 1, 'x')));
  EXPECT_FALSE(a.Append("yz"));
  EXPECT_EQ(a.size(), kMiB - 1);
  EXPECT_TRUE(a.Append("y"));
  EXPECT_EQ(a.size(), kMiB);
}

// Room made for a copy to fill: where Append would put the bytes, or nothing beyond capacity.
TEST(PinnedPoolTest, ExtendMakesRoomAtTheEndOrNothing) {
  CountingAllocator alloc;
  auto pool = PinnedPool::Create(alloc.Fn(), 64 * kMiB);
  PinnedBytes a = pool->Take(1);
  ASSERT_TRUE(a.Append("ab"));
  char* room = a.Extend(3);
  ASSERT_NE(room, nullptr);
  EXPECT_EQ(room, a.view().data() + 2);
  std::memcpy(room, "cde", 3);
  EXPECT_EQ(a.view(), "abcde");
  EXPECT_EQ(a.Extend(kMiB), nullptr);
  EXPECT_EQ(a.size(), 5u);
  EXPECT_NE(a.Extend(kMiB - 5), nullptr);
  EXPECT_EQ(a.size(), kMiB);
  EXPECT_EQ(PinnedBytes().Extend(1), nullptr);
}

TEST(PinnedPoolTest, TheSmallestIdleBufferThatFitsIsTaken) {
  CountingAllocator alloc;
  auto pool = PinnedPool::Create(alloc.Fn(), 64 * kMiB);
  {
    PinnedBytes big = pool->Take(16 * kMiB);
    PinnedBytes mid = pool->Take(6 * kMiB);
    PinnedBytes small = pool->Take(2 * kMiB);
  }
  ASSERT_EQ(alloc.calls, 3);
  PinnedBytes a = pool->Take(5 * kMiB);
  PinnedBytes b = pool->Take(kMiB);
  PinnedBytes c = pool->Take(kMiB);  // larger than asked rather than a new allocation
  EXPECT_EQ(a.capacity(), 6 * kMiB);
  EXPECT_EQ(b.capacity(), 2 * kMiB);
  EXPECT_EQ(c.capacity(), 16 * kMiB);
  EXPECT_EQ(alloc.calls, 3);
  EXPECT_EQ(pool->Take(kMiB).capacity(), kMiB);  // none idle: a new one
  EXPECT_EQ(alloc.calls, 4);
}

TEST(PinnedPoolTest, BeyondTheIdleBoundTheLeastRecentlyUsedAreFreed) {
  CountingAllocator alloc;
  auto pool = PinnedPool::Create(alloc.Fn(), 6 * kMiB);
  {
    PinnedBytes a = pool->Take(4 * kMiB);
    PinnedBytes b = pool->Take(4 * kMiB);
    EXPECT_EQ(pool->held_bytes(), 8 * kMiB);
  }
  EXPECT_EQ(pool->idle_bytes(), 4 * kMiB);
  EXPECT_EQ(pool->held_bytes(), 4 * kMiB);
  // The size in use grows: the buffers given back stay, and the old size leaves.
  for (int i = 0; i < 3; ++i) {
    PinnedBytes c = pool->Take(5 * kMiB);
  }
  EXPECT_EQ(pool->idle_bytes(), 5 * kMiB);
  EXPECT_EQ(pool->held_bytes(), 5 * kMiB);
  EXPECT_EQ(alloc.calls, 3);  // 2 of 4 MiB, 1 of 5 MiB, recycled from the second round on
  EXPECT_EQ(pool->Take(4 * kMiB).capacity(), 5 * kMiB);
  EXPECT_EQ(alloc.calls, 3);
}

TEST(PinnedPoolTest, ABufferOutlivesItsPoolsLastOtherHolder) {
  CountingAllocator alloc;
  auto pool = PinnedPool::Create(alloc.Fn(), 64 * kMiB);
  PinnedBytes a = pool->Take(kMiB);
  pool.reset();  // the buffer keeps the pool alive and gives itself back to it
  ASSERT_TRUE(a.Append("still mine"));
  EXPECT_EQ(a.view(), "still mine");
}

TEST(PinnedPoolTest, ABackendWithoutPageLockedMemoryIsAskedOnce) {
  CountingAllocator alloc;
  alloc.fail = absl::UnimplementedError("no page-locked memory on this backend");
  auto pool = PinnedPool::Create(alloc.Fn(), 64 * kMiB);
  EXPECT_FALSE(pool->Take(kMiB));
  EXPECT_FALSE(pool->Take(kMiB));
  EXPECT_EQ(alloc.calls, 1);
}

TEST(PinnedPoolTest, AFailedAllocationIsEmptyAndTriedAgainNextTime) {
  CountingAllocator alloc;
  alloc.fail = absl::ResourceExhaustedError("out of page-locked memory");
  auto pool = PinnedPool::Create(alloc.Fn(), 64 * kMiB);
  EXPECT_FALSE(pool->Take(kMiB));
  alloc.fail = absl::OkStatus();
  EXPECT_TRUE(pool->Take(kMiB));
  EXPECT_EQ(alloc.calls, 2);
  EXPECT_FALSE(pool->Take(0));
}

}  // namespace
}  // namespace losshead::server
