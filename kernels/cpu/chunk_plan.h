// How the CPU backend splits one problem into token chunks and weight blocks within a workspace.
#ifndef LOSSHEAD_KERNELS_CPU_CHUNK_PLAN_H_
#define LOSSHEAD_KERNELS_CPU_CHUNK_PLAN_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "losshead/kernels/problem.h"
#include "losshead/kernels/shard_problem.h"

namespace losshead::kernels {

// Upper bound on the tokens per chunk: the workspace never grows with N beyond this.
inline constexpr int64_t kCpuMaxChunkRows = 512;
// Every workspace region starts on this boundary; the plan reserves room to align the base too.
inline constexpr size_t kCpuWorkspaceAlignment = 64;

// The workspace layout for one problem. Offsets are relative to the workspace base rounded up to
// kCpuWorkspaceAlignment; `bytes` includes the slack for that rounding. Regions:
//   logits       chunk_rows x v fp32, overwritten by the gradient with respect to the logits
//   row_stats    chunk_rows x 2 double (per-token loss and lse)
//   hidden       chunk_rows x d fp32 copy of the H chunk     (bf16/fp16 only; fp32 is used in
//   place) grad_hidden  chunk_rows x d fp32 dH chunk before rounding (bf16/fp16 only) weight
//   weight_block_rows x d fp32 copy of W rows   (bf16/fp16 only)
// weight_block_rows == v means W is converted once per call and reused by every chunk.
struct ChunkPlan {
  int64_t chunk_rows = 0;
  int64_t weight_block_rows = 0;
  bool converts_inputs = false;
  size_t logits_offset = 0;
  size_t row_stats_offset = 0;
  size_t hidden_offset = 0;
  size_t grad_hidden_offset = 0;
  size_t weight_offset = 0;
  size_t bytes = 0;
};

// The largest plan that fits in `budget_bytes`: it prefers converting all of W once, then the
// largest weight block that still allows a reasonably large token chunk. Planning again with the
// returned `bytes` as the budget gives the same plan. RESOURCE_EXHAUSTED if even one token and one
// weight row do not fit. `problem` must already be valid.
absl::StatusOr<ChunkPlan> PlanChunks(const Problem& problem, size_t budget_bytes);

// The workspace of a vocabulary shard (see shard_problem.h), offsets as ChunkPlan's:
//   scalars      the micro-batch's fp64 loss accumulator, grad scale and token count
//   logits       chunk_rows x rows fp32: z from ShardForward, then G in ShardBackward
//   row_stats    chunk_rows x 2 double (per-token loss and lse)
//   hidden       chunk_rows x d fp32 copy of the H chunk (bf16/fp16 only)
//   weight       rows x d fp32 copy of the shard's W, made by each call (bf16/fp16 only)
// `plan` is what PlanShard answers: bytes above as workspace_bytes, with the caller's statistics
// and dH partial buffers counted against the budget too.
struct ShardChunkPlan {
  ShardPlan plan;
  bool converts_inputs = false;
  size_t scalars_offset = 0;
  size_t logits_offset = 0;
  size_t row_stats_offset = 0;
  size_t hidden_offset = 0;
  size_t weight_offset = 0;
};

// The layout for chunks of `chunk_rows` tokens.
ShardChunkPlan LayoutShard(const ShardProblem& shard, int64_t chunk_rows);
// The largest chunk (at most min(n, kCpuMaxChunkRows)) whose workspace, statistics and partials
// fit `budget_bytes`; RESOURCE_EXHAUSTED when one token does not. `shard` must already be valid.
absl::StatusOr<ShardChunkPlan> PlanShardChunks(const ShardProblem& shard, size_t budget_bytes);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CPU_CHUNK_PLAN_H_
