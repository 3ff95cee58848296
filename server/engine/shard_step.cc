// A vocabulary-sharded head's micro-batch: every shard computes its rows' logits of each token
// chunk, the shards exchange their softmax statistics (AllGather), each writes its columns of the
// gradient and its part of dH and dW (or of its stash: deferred dW), and the dH parts are summed
// (AllReduce) and rounded on shard 0, which returns the results. The sequence and its math are the
// backend's (see losshead/kernels/shard_problem.h); this file drives it over the shards' streams
// under the cut.
#include <algorithm>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "server/engine/head.h"
#include "server/engine/replica_group.h"
#include "common/status_macros.h"

namespace losshead::server {

absl::Status Head::PrepareShards(ShardRun& run) {
  const int k = group_->size();
  run.shards.clear();
  run.workspace_bytes.clear();
  run.chunk_rows = run.problem.n;
  for (const auto& r : group_->replicas()) {
    const kernels::ShardProblem shard{.problem = run.problem,
                                      .row_begin = r->rows.begin,
                                      .rows = r->rows.size(),
                                      .shards = k,
                                      .rank = r->rank};
    LOSSHEAD_ASSIGN_OR_RETURN(const kernels::ShardPlan plan,
                              r->backend.PlanShard(shard, options_.workspace_budget_bytes));
    run.shards.push_back(shard);
    run.workspace_bytes.push_back(plan.workspace_bytes);
    // Shards differ by at most one row: the smallest chunk fits every shard's plan.
    run.chunk_rows = std::min(run.chunk_rows, plan.chunk_rows);
  }
  run.chunk_rows = kernels::BalancedChunkRows(run.problem.n, run.chunk_rows);
  const int64_t stats_floats = int64_t{k} * kernels::kShardStats * run.chunk_rows;
  const int64_t partial_floats = run.grad_hidden ? run.chunk_rows * hidden_size() : 0;
  for (const auto& r : group_->replicas()) {
    LOSSHEAD_RETURN_IF_ERROR(EnsureBuffer(*r, r->workspace, run.workspace_bytes[r->rank], true));
    LOSSHEAD_RETURN_IF_ERROR(EnsureBuffer(*r, r->shard_stats, stats_floats * sizeof(float), true));
    LOSSHEAD_RETURN_IF_ERROR(
        EnsureBuffer(*r, r->shard_partial, partial_floats * sizeof(float), true));
  }
  // Deferred dW, after the buffers (which may have taken a stash's memory back): each shard's
  // columns of G wait in a stash of its own, laid out as for a head of the shard's rows.
  run.stashes.assign(k, kernels::GradStash{});
  if (!run.grad_weight) return absl::OkStatus();
  // The shards' stashes fill in step: those this micro-batch overflows flush together, on every
  // device at once, rather than one by one in StashFor.
  std::vector<Replica*> full;
  for (const auto& r : group_->replicas()) {
    if (r->StashFullFor(run.problem.n)) full.push_back(r.get());
  }
  LOSSHEAD_RETURN_IF_ERROR(group_->FlushStashes(full));
  for (const auto& r : group_->replicas()) {
    LOSSHEAD_ASSIGN_OR_RETURN(run.stashes[r->rank],
                              StashFor(*r, kernels::ShardStashShape(run.shards[r->rank])));
  }
  return absl::OkStatus();
}

absl::Status Head::RunShards(const ShardRun& run, std::span<IoSlot* const> slots) {
  const int k = group_->size();
  std::vector<kernels::ShardArguments> args(k);
  for (const auto& r : group_->replicas()) {
    const IoSlot& slot = *slots[r->rank];
    kernels::ShardArguments& a = args[r->rank];
    a.hidden = slot.hidden.data();
    a.weight = r->weights.data();
    a.targets = slot.targets.as<int32_t>();
    // Forward-only: no dW, as on one device; dH is still computed when asked for.
    a.grad_stash = run.stashes[r->rank];
    a.grad_weight = run.grad_weight && a.grad_stash.data == nullptr ? r->grad.as<float>() : nullptr;
    a.grad_hidden_partial = run.grad_hidden ? r->shard_partial.as<float>() : nullptr;
    a.stats = r->shard_stats.as<float>();
    a.stats_chunk_rows = run.chunk_rows;
    a.workspace = r->workspace.data();
    a.workspace_bytes = run.workspace_bytes[r->rank];
    if (r->rank == 0) {
      // token_count first: it needs 8-byte alignment.
      a.token_count = slot.scalars.as<int64_t>();
      a.loss_sum = reinterpret_cast<float*>(slot.scalars.as<char>() + 8);
      a.per_token_loss = run.per_token ? slot.per_token.as<float>() : nullptr;
    }
    LOSSHEAD_RETURN_IF_ERROR(r->backend.ShardBegin(run.shards[r->rank], a, *r->stream));
  }
  Replica& first = (*group_)[0];
  for (int64_t t0 = 0; t0 < run.problem.n; t0 += run.chunk_rows) {
    const kernels::ShardChunk chunk{.begin = t0,
                                    .size = std::min(run.chunk_rows, run.problem.n - t0)};
    for (const auto& r : group_->replicas()) {
      LOSSHEAD_RETURN_IF_ERROR(
          r->backend.ShardForward(run.shards[r->rank], args[r->rank], chunk, *r->stream));
    }
    LOSSHEAD_RETURN_IF_ERROR(group_->GatherShardStats(run.chunk_rows));
    for (const auto& r : group_->replicas()) {
      LOSSHEAD_RETURN_IF_ERROR(
          r->backend.ShardBackward(run.shards[r->rank], args[r->rank], chunk, *r->stream));
    }
    if (!run.grad_hidden) continue;
    LOSSHEAD_RETURN_IF_ERROR(group_->SumShardPartials(chunk.size * hidden_size()));
    LOSSHEAD_RETURN_IF_ERROR(
        first.backend.ShardStoreGradHidden(run.shards[0], first.shard_partial.as<float>(), chunk,
                                           slots[0]->grad_hidden.data(), *first.stream));
  }
  return absl::OkStatus();
}

}  // namespace losshead::server
