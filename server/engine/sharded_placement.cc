#include "server/engine/sharded_placement.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/status_macros.h"
#include "server/engine/device_scratch.h"

namespace losshead::server {

ShardedPlacement::ShardedPlacement(std::unique_ptr<ReplicaGroup> group)
    : Placement(std::move(group)) {
  for (const auto& r : this->group().replicas()) shards_.push_back(r.get());
}

kernels::ShardProblem ShardedPlacement::ShardOf(const kernels::Problem& problem,
                                                const Replica& shard) const {
  return kernels::ShardProblem{.problem = problem,
                               .row_begin = shard.rows.begin,
                               .rows = shard.rows.size(),
                               .shards = group().shard_count(),
                               .rank = group().first_shard() + shard.rank};
}

absl::Status ShardedPlacement::CheckWorkspace(Replica& replica, size_t budget) const {
  const kernels::Problem probe{.n = 1,
                               .d = group().hidden_size(),
                               .v = group().vocab_size(),
                               .dtype = group().dtype(),
                               .precision = group().precision()};
  return replica.backend.PlanShard(ShardOf(probe, replica), budget).status();
}

void ShardedPlacement::Take(int64_t tokens, StepDevices& devices) {
  // Its tokens count as queued on every shard until its run is over (or it fails before), which
  // keeps their stashes' idle flush away.
  for (Replica* shard : shards_) devices.Queue(*shard, tokens);
  devices.TakeSlots();
}

absl::Status ShardedPlacement::Prepare(const StepRun& run, StepDevices& devices,
                                       DeviceScratch& scratch) {
  const int k = group().size();
  parts_.clear();
  workspace_bytes_.clear();
  chunk_rows_ = run.problem.n;
  for (Replica* r : shards_) {
    const kernels::ShardProblem shard = ShardOf(run.problem, *r);
    LOSSHEAD_ASSIGN_OR_RETURN(const kernels::ShardPlan plan,
                              r->backend.PlanShard(shard, run.workspace_budget));
    parts_.push_back(shard);
    workspace_bytes_.push_back(plan.workspace_bytes);
    // Shards differ by at most one row: the smallest chunk fits every shard's plan.
    chunk_rows_ = std::min(chunk_rows_, plan.chunk_rows);
  }
  if (group().across_processes()) {
    // Every process must run the same chunks: the plans of the other processes' shards too,
    // made here (a plan depends on the problem, the shard's rows and the budget, and every
    // process's backends are of one kind), so that no exchange is needed to agree.
    const int shards = group().shard_count();
    for (int rank = 0; rank < shards; ++rank) {
      const kernels::Shard rows = kernels::ShardRange(group().vocab_size(), shards, rank);
      const kernels::ShardProblem other{.problem = run.problem,
                                        .row_begin = rows.begin,
                                        .rows = rows.size(),
                                        .shards = shards,
                                        .rank = rank};
      LOSSHEAD_ASSIGN_OR_RETURN(const kernels::ShardPlan plan,
                                shards_[0]->backend.PlanShard(other, run.workspace_budget));
      chunk_rows_ = std::min(chunk_rows_, plan.chunk_rows);
    }
  }
  chunk_rows_ = kernels::BalancedChunkRows(run.problem.n, chunk_rows_);
  // The statistics hold a slice per shard of every process.
  const int64_t all_shards = group().shard_count();
  const int64_t stats_floats = all_shards * kernels::kShardStats * chunk_rows_;
  const int64_t partial_floats = run.grad_hidden ? chunk_rows_ * group().hidden_size() : 0;
  // The distribution outputs' statistics, on every shard, only when one is asked for or the
  // entropy term needs s (shard_problem.h): a micro-batch without them grows nothing and
  // exchanges nothing more.
  const bool entropy_term = run.problem.options.entropy_coef != 0.0f;
  output_stats_rows_ = run.outputs.distribution() || entropy_term
                           ? kernels::ShardOutputStatsRows(run.outputs.top_k)
                           : 0;
  const int64_t output_stats_floats = all_shards * output_stats_rows_ * chunk_rows_;
  for (Replica* r : shards_) {
    LOSSHEAD_RETURN_IF_ERROR(scratch.Ensure(*r, r->workspace, workspace_bytes_[r->rank], true));
    LOSSHEAD_RETURN_IF_ERROR(
        scratch.Ensure(*r, r->shard_stats, stats_floats * sizeof(float), true));
    LOSSHEAD_RETURN_IF_ERROR(
        scratch.Ensure(*r, r->shard_partial, partial_floats * sizeof(float), true));
    LOSSHEAD_RETURN_IF_ERROR(
        scratch.Ensure(*r, r->shard_output_stats, output_stats_floats * sizeof(float), true));
  }
  // Deferred dW, after the buffers (which may have taken a stash's memory back): each shard's
  // columns of G wait in a stash of its own, laid out as for a head of the shard's rows.
  for (int i = 0; i < k; ++i) devices.stash(i) = kernels::GradStash{};
  if (!run.grad_weight) return absl::OkStatus();
  // The shards' stashes fill in step: those this micro-batch overflows flush together, on every
  // device at once, rather than one by one in StashFor.
  std::vector<Replica*> full;
  for (Replica* r : shards_) {
    if (r->StashFullFor(run.problem.n)) full.push_back(r);
  }
  LOSSHEAD_RETURN_IF_ERROR(group().FlushStashes(full));
  for (Replica* r : shards_) {
    LOSSHEAD_ASSIGN_OR_RETURN(devices.stash(r->rank),
                              scratch.StashFor(*r, kernels::ShardStashShape(parts_[r->rank])));
  }
  return absl::OkStatus();
}

absl::Status ShardedPlacement::Run(const StepRun& run, StepDevices& devices) {
  const IoSlot& out = devices.slot(0);
  args_.assign(shards_.size(), kernels::ShardArguments{});
  for (Replica* r : shards_) {
    const IoSlot& slot = devices.slot(r->rank);
    kernels::ShardArguments& a = args_[r->rank];
    a.hidden = slot.hidden.data();
    a.weight = r->weights.data();
    a.targets = slot.targets.as<int32_t>();
    // Forward-only: no dW, as on one device; dH is still computed when asked for.
    a.grad_stash = devices.stash(r->rank);
    a.grad_weight = run.grad_weight && a.grad_stash.data == nullptr ? r->grad.as<float>() : nullptr;
    a.grad_hidden_partial = run.grad_hidden ? r->shard_partial.as<float>() : nullptr;
    a.stats = r->shard_stats.as<float>();
    a.stats_chunk_rows = chunk_rows_;
    a.workspace = r->workspace.data();
    a.workspace_bytes = workspace_bytes_[r->rank];
    // The output bias over this shard's rows (empty without one), its gradient with dW's.
    a.bias = r->bias.data() != nullptr ? r->bias.as<float>() : nullptr;
    a.grad_bias = a.bias != nullptr && run.grad_weight ? r->grad_bias.as<float>() : nullptr;
    // The loss terms' per-token inputs, on every shard (each computes its rows' part).
    a.token_weights = TokenInputIn(slot, run, TokenInput::kWeight);
    a.old_logprob = TokenInputIn(slot, run, TokenInput::kOldLogprob);
    a.advantages = TokenInputIn(slot, run, TokenInput::kAdvantage);
    a.ref_logprob = TokenInputIn(slot, run, TokenInput::kRefLogprob);
    // The outputs' statistics on every shard, with the same top_k (shard_problem.h's contract):
    // each shard computes its columns' part, shard 0 combines them into the outputs.
    if (output_stats_rows_ > 0) {
      a.output_stats = r->shard_output_stats.as<float>();
      a.top_k = run.outputs.top_k;
    }
    if (r->rank == 0) {
      char* scalars = out.scalars.as<char>();
      a.token_count = reinterpret_cast<int64_t*>(scalars + kTokenCountOffset);
      a.loss_sum = reinterpret_cast<float*>(scalars + kLossSumOffset);
      a.per_token_loss = run.per_token ? out.per_token.as<float>() : nullptr;
      a.per_token_logprob = TokenOutputIn<float>(out, run, TokenOutput::kLogprob);
      a.per_token_entropy = TokenOutputIn<float>(out, run, TokenOutput::kEntropy);
      a.per_token_lse = TokenOutputIn<float>(out, run, TokenOutput::kLse);
      a.per_token_argmax = TokenOutputIn<int32_t>(out, run, TokenOutput::kArgmax);
      a.correct_count = run.outputs.correct_count
                            ? reinterpret_cast<int64_t*>(scalars + kCorrectCountOffset)
                            : nullptr;
      a.top_k_ids = TopKIdsIn(out, run);
      a.top_k_logprobs = TopKLogprobsIn(out, run);
    }
    // ShardBegin validates and touches no dW: a refusal here (UNIMPLEMENTED for what the backend
    // does not compute over shards) leaves nothing computed, as Placement::Run promises.
    LOSSHEAD_RETURN_IF_ERROR(r->backend.ShardBegin(parts_[r->rank], a, *r->stream));
  }
  if (run.hidden_root >= 0) {
    // The hidden states from the one shard that staged them to every other, on the shards'
    // streams ahead of their chunks.
    std::vector<void*> hidden;
    for (Replica* r : shards_) hidden.push_back(devices.slot(r->rank).hidden.data());
    LOSSHEAD_RETURN_IF_ERROR(group().BroadcastShards(hidden, run.problem.n * run.problem.d,
                                                     run.problem.dtype, run.hidden_root));
  }
  absl::Status ran = RunChunks(run, devices);
  // From here on a part of the run may be in dW: no error may read as a refusal.
  if (absl::IsUnimplemented(ran)) return absl::InternalError(ran.message());
  return ran;
}

absl::Status ShardedPlacement::RunChunks(const StepRun& run, StepDevices& devices) {
  const IoSlot& out = devices.slot(0);
  Replica& first = *shards_[0];
  // dH is summed on the shard that returns it: this process's first, or across processes the
  // micro-batch's origin's first (the one that holds its hidden states).
  const int root = run.hidden_root >= 0 ? run.hidden_root : group().first_shard();
  for (int64_t t0 = 0; t0 < run.problem.n; t0 += chunk_rows_) {
    const kernels::ShardChunk chunk{.begin = t0, .size = std::min(chunk_rows_, run.problem.n - t0)};
    for (Replica* r : shards_) {
      LOSSHEAD_RETURN_IF_ERROR(
          r->backend.ShardForward(parts_[r->rank], args_[r->rank], chunk, *r->stream));
    }
    LOSSHEAD_RETURN_IF_ERROR(group().GatherShardStats(chunk_rows_, output_stats_rows_));
    for (Replica* r : shards_) {
      LOSSHEAD_RETURN_IF_ERROR(
          r->backend.ShardBackward(parts_[r->rank], args_[r->rank], chunk, *r->stream));
    }
    if (!run.grad_hidden) continue;
    LOSSHEAD_RETURN_IF_ERROR(group().SumShardPartials(chunk.size * group().hidden_size(), root));
    if (group().first_shard() != root) continue;  // another process returns dH
    LOSSHEAD_RETURN_IF_ERROR(first.backend.ShardStoreGradHidden(
        parts_[0], first.shard_partial.as<float>(), chunk, out.grad_hidden.data(), *first.stream));
  }
  return absl::OkStatus();
}

}  // namespace losshead::server
