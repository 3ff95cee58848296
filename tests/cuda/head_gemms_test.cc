// How head_gemms.h splits a width into the aligned bulk and the tail, and how its calls step
// through the operands: host logic, so it runs with or without a GPU.
#include "kernels/cuda/head_gemms.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace losshead::kernels::cuda {
namespace {

TEST(SplitWidthTest, BulkOfWholeVectorsThenATailShorterThanOne) {
  for (int64_t width = 1; width <= 200; ++width) {
    SCOPED_TRACE(width);
    const WidthParts parts = SplitWidth(width);
    ASSERT_GE(parts.count, 1);
    int64_t next = 0;
    for (const WidthPart& part : parts) {
      EXPECT_EQ(part.begin, next) << "parts follow one another";
      EXPECT_GT(part.size, 0) << "no empty part";
      next = part.begin + part.size;
    }
    EXPECT_EQ(next, width) << "the parts cover the width";
    const WidthPart& first = parts.part[0];
    if (width >= kWidthAlign) {
      EXPECT_EQ(first.size % kWidthAlign, 0) << "the bulk is whole vectors";
      EXPECT_LT(width - first.size, kWidthAlign) << "the bulk is as large as it can be";
    } else {
      EXPECT_EQ(parts.count, 1);
      EXPECT_EQ(first.size, width) << "a width below one vector is all tail";
    }
    EXPECT_EQ(WidthSplits(width), width > kWidthAlign && width % kWidthAlign != 0);
  }
  const WidthParts wide = SplitWidth(695970);
  ASSERT_EQ(wide.count, 2);
  EXPECT_EQ(wide.part[0].size, 695968);
  EXPECT_EQ(wide.part[1].begin, 695968);
  EXPECT_EQ(wide.part[1].size, 2);
  EXPECT_EQ(SplitWidth(128256).count, 1);
  EXPECT_EQ(SplitWidth(0).count, 0);
}

TEST(SplitWidthTest, AdvanceStepsByTheOperandsElementSize) {
  alignas(16) char bytes[64] = {};
  EXPECT_EQ(Advance(static_cast<void*>(bytes), 3, CUDA_R_16BF), bytes + 6);
  EXPECT_EQ(Advance(static_cast<void*>(bytes), 3, CUDA_R_16F), bytes + 6);
  EXPECT_EQ(Advance(static_cast<void*>(bytes), 3, CUDA_R_32F), bytes + 12);
  const void* constant = bytes;
  EXPECT_EQ(Advance(constant, 8, CUDA_R_16BF), bytes + 16);
}

}  // namespace
}  // namespace losshead::kernels::cuda
