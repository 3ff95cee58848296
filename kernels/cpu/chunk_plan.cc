#include "kernels/cpu/chunk_plan.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

namespace losshead::kernels {
namespace {

// Below this many tokens per chunk the GEMMs lose most of their efficiency, so a smaller weight
// block is preferred over a smaller chunk.
constexpr int64_t kPreferredMinChunkRows = 64;

size_t AlignUp(size_t bytes) {
  return (bytes + kCpuWorkspaceAlignment - 1) / kCpuWorkspaceAlignment * kCpuWorkspaceAlignment;
}

ChunkPlan Layout(const Problem& problem, int64_t chunk_rows, int64_t weight_block_rows) {
  const size_t c = static_cast<size_t>(chunk_rows);
  const size_t d = static_cast<size_t>(problem.d);
  ChunkPlan plan;
  plan.chunk_rows = chunk_rows;
  plan.weight_block_rows = weight_block_rows;
  plan.converts_inputs = problem.dtype != DType::kFP32;
  size_t offset = 0;
  plan.logits_offset = offset;
  offset += AlignUp(c * static_cast<size_t>(problem.v) * sizeof(float));
  plan.row_stats_offset = offset;
  offset += AlignUp(c * 2 * sizeof(double));
  if (plan.converts_inputs) {
    plan.hidden_offset = offset;
    offset += AlignUp(c * d * sizeof(float));
    plan.grad_hidden_offset = offset;
    offset += AlignUp(c * d * sizeof(float));
    plan.weight_offset = offset;
    offset += AlignUp(static_cast<size_t>(weight_block_rows) * d * sizeof(float));
  }
  plan.bytes = offset + kCpuWorkspaceAlignment;
  return plan;
}

// Largest chunk in [1, max_rows] whose layout fits, or 0 if none does.
int64_t MaxChunkRows(const Problem& problem, int64_t weight_block_rows, int64_t max_rows,
                     size_t budget_bytes) {
  int64_t lo = 0;
  int64_t hi = max_rows;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (Layout(problem, mid, weight_block_rows).bytes <= budget_bytes) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace

absl::StatusOr<ChunkPlan> PlanChunks(const Problem& problem, size_t budget_bytes) {
  const int64_t max_rows = std::min(problem.n, kCpuMaxChunkRows);
  std::vector<int64_t> blocks = {problem.v};
  if (problem.dtype != DType::kFP32) {
    for (int64_t block : {8192, 2048, 512, 128, 32, 8, 1}) {
      if (block < problem.v) blocks.push_back(block);
    }
  }
  // First choice: the largest weight block that leaves a useful chunk; failing that, anything.
  const int64_t wanted_rows = std::min(max_rows, kPreferredMinChunkRows);
  for (int64_t min_rows : {wanted_rows, int64_t{1}}) {
    for (int64_t block : blocks) {
      const int64_t rows = MaxChunkRows(problem, block, max_rows, budget_bytes);
      if (rows >= min_rows) return Layout(problem, rows, block);
    }
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "cpu backend needs at least ", Layout(problem, 1, 1).bytes,
      " workspace bytes for v=", problem.v, " d=", problem.d, ", budget is ", budget_bytes));
}

ShardChunkPlan LayoutShard(const ShardProblem& shard, int64_t chunk_rows) {
  const size_t c = static_cast<size_t>(chunk_rows);
  const size_t d = static_cast<size_t>(shard.problem.d);
  ShardChunkPlan layout;
  layout.converts_inputs = shard.problem.dtype != DType::kFP32;
  size_t offset = 0;
  layout.scalars_offset = offset;
  offset += AlignUp(4 * sizeof(double));
  layout.logits_offset = offset;
  offset += AlignUp(c * static_cast<size_t>(shard.rows) * sizeof(float));
  layout.row_stats_offset = offset;
  offset += AlignUp(c * 2 * sizeof(double));
  if (layout.converts_inputs) {
    layout.hidden_offset = offset;
    offset += AlignUp(c * d * sizeof(float));
    layout.weight_offset = offset;
    offset += AlignUp(static_cast<size_t>(shard.rows) * d * sizeof(float));
  }
  layout.plan.chunk_rows = chunk_rows;
  layout.plan.workspace_bytes = offset + kCpuWorkspaceAlignment;
  layout.plan.stats_floats = static_cast<int64_t>(shard.shards) * kShardStats * chunk_rows;
  layout.plan.partial_floats = chunk_rows * shard.problem.d;
  return layout;
}

absl::StatusOr<ShardChunkPlan> PlanShardChunks(const ShardProblem& shard, size_t budget_bytes) {
  auto total = [&](int64_t rows) {
    const ShardPlan plan = LayoutShard(shard, rows).plan;
    return plan.workspace_bytes +
           static_cast<size_t>(plan.stats_floats + plan.partial_floats) * sizeof(float);
  };
  int64_t lo = 0;
  int64_t hi = std::min(shard.problem.n, kCpuMaxChunkRows);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (total(mid) <= budget_bytes) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  if (lo == 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu backend needs at least ", total(1), " bytes for a shard of ", shard.rows,
                     " rows with d=", shard.problem.d,
                     " (workspace, statistics and dH partials), budget is ", budget_bytes));
  }
  return LayoutShard(shard, lo);
}

}  // namespace losshead::kernels
