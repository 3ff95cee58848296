// The CPU backend's workspace sizing: bounded, independent of N beyond one chunk, stable.
#include <cstdint>

#include "gtest/gtest.h"
#include "kernels/cpu/chunk_plan.h"
#include "kernels/cpu/cpu_backend.h"

namespace losshead::kernels {
namespace {

TEST(CpuWorkspaceTest, AllDTypes_V32000_D1024_IndependentOfNBeyondOneChunk) {
  std::unique_ptr<Backend> backend = CreateCpuBackend(1);
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    for (size_t budget : {size_t{1} << 20, size_t{64} << 20, size_t{1} << 30}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " budget " << budget);
      Problem p{.n = kCpuMaxChunkRows, .d = 1024, .v = 32000, .dtype = dtype};
      absl::StatusOr<size_t> at_cap = backend->WorkspaceBytes(p, budget);
      p.n = int64_t{1} << 40;
      absl::StatusOr<size_t> huge_n = backend->WorkspaceBytes(p, budget);
      ASSERT_TRUE(at_cap.ok()) << at_cap.status();
      ASSERT_TRUE(huge_n.ok()) << huge_n.status();
      EXPECT_EQ(*at_cap, *huge_n);
      EXPECT_LE(*huge_n, budget);
    }
  }
}

TEST(CpuWorkspaceTest, BF16_V997_D67_PlanningWithItsOwnSizeGivesTheSamePlan) {
  const Problem p{.n = 300, .d = 67, .v = 997, .dtype = DType::kBF16};
  for (size_t budget = 4096; budget < (size_t{4} << 20); budget = budget * 3 / 2) {
    SCOPED_TRACE(budget);
    absl::StatusOr<ChunkPlan> plan = PlanChunks(p, budget);
    if (!plan.ok()) {
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
      continue;
    }
    EXPECT_LE(plan->bytes, budget);
    absl::StatusOr<ChunkPlan> again = PlanChunks(p, plan->bytes);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->chunk_rows, plan->chunk_rows);
    EXPECT_EQ(again->weight_block_rows, plan->weight_block_rows);
    EXPECT_EQ(again->bytes, plan->bytes);
  }
}

TEST(CpuWorkspaceTest, BF16_N1_D67_V997_SmallProblemNeedsOnlyOneToken) {
  const Problem p{.n = 1, .d = 67, .v = 997, .dtype = DType::kBF16};
  absl::StatusOr<ChunkPlan> plan = PlanChunks(p, size_t{1} << 30);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->chunk_rows, 1);
  EXPECT_EQ(plan->weight_block_rows, 997);  // W converted once
}

}  // namespace
}  // namespace losshead::kernels
