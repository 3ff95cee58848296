#include "common/parallel_copy.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace losshead {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> bytes(n);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

// Sizes around every boundary: below the parallel threshold, at it, pieces plus a tail, and at
// odd offsets into both buffers. The bytes around the destination range stay untouched.
TEST(ParallelCopyTest, EqualsMemcpyAtEverySize) {
  const size_t piece = kParallelCopyPieceBytes;
  const std::vector<size_t> sizes = {0,
                                     1,
                                     4095,
                                     kParallelCopyMinBytes - 1,
                                     kParallelCopyMinBytes,
                                     kParallelCopyMinBytes + 1,
                                     5 * piece - 3,
                                     33 * piece + 17};
  uint64_t seed = std::random_device{}();
  for (size_t n : sizes) {
    for (size_t offset : {size_t{0}, size_t{3}}) {
      SCOPED_TRACE(testing::Message() << "bytes " << n << ", offset " << offset << ", seed "
                                      << seed);
      const std::vector<uint8_t> src = RandomBytes(n + offset, seed++);
      std::vector<uint8_t> dst = RandomBytes(n + 2 * offset + 8, seed++);
      std::vector<uint8_t> expected = dst;
      std::copy(src.begin() + offset, src.end(), expected.begin() + offset + 1);
      ParallelCopy(dst.data() + offset + 1, src.data() + offset, n);
      ASSERT_TRUE(dst == expected);
    }
  }
}

// Callers at once share the helpers; each gets its own bytes whole.
TEST(ParallelCopyTest, ConcurrentCallersEachGetTheirBytes) {
  constexpr int kCallers = 6;
  const size_t n = 9 * kParallelCopyPieceBytes + 5;
  const uint64_t seed = std::random_device{}();
  std::vector<std::vector<uint8_t>> src(kCallers), dst(kCallers);
  for (int i = 0; i < kCallers; ++i) {
    src[i] = RandomBytes(n, seed + i);
    dst[i].assign(n, 0);
  }
  std::vector<std::thread> callers;
  for (int i = 0; i < kCallers; ++i) {
    callers.emplace_back([&, i] {
      for (int round = 0; round < 5; ++round) ParallelCopy(dst[i].data(), src[i].data(), n);
    });
  }
  for (std::thread& t : callers) t.join();
  for (int i = 0; i < kCallers; ++i) {
    EXPECT_TRUE(dst[i] == src[i]) << "caller " << i << ", seed " << seed;
  }
}

}  // namespace
}  // namespace losshead
