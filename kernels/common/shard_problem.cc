// What every backend checks of a vocabulary shard, and the default of a backend without shards.
#include "losshead/kernels/shard_problem.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "losshead/kernels/backend.h"

namespace losshead::kernels {

absl::Status ValidateShardProblem(const ShardProblem& shard) {
  if (absl::Status status = ValidateProblem(shard.problem); !status.ok()) return status;
  if (shard.rows < 1 || shard.row_begin < 0 || shard.row_begin > shard.problem.v - shard.rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard rows [", shard.row_begin, ", ", shard.row_begin + shard.rows,
                     ") must be a non-empty part of [0, ", shard.problem.v, ")"));
  }
  if (shard.shards < 1 || shard.rank < 0 || shard.rank >= shard.shards) {
    return absl::InvalidArgumentError(absl::StrCat("shard rank ", shard.rank, " of ", shard.shards,
                                                   " shards is outside [0, ", shard.shards, ")"));
  }
  return absl::OkStatus();
}

namespace {

// The terms' pointers of a shard call as Arguments carries them, for ValidateLossInputs.
Arguments TermPointersOf(const ShardArguments& args) {
  Arguments view;
  view.bias = args.bias;
  view.grad_bias = args.grad_bias;
  view.token_weights = args.token_weights;
  view.old_logprob = args.old_logprob;
  view.advantages = args.advantages;
  view.ref_logprob = args.ref_logprob;
  return view;
}

}  // namespace

absl::Status ValidateShardArguments(const ShardProblem& shard, const ShardArguments& args) {
  if (absl::Status status = ValidateShardProblem(shard); !status.ok()) return status;
  if (args.hidden == nullptr || args.weight == nullptr || args.targets == nullptr ||
      args.stats == nullptr) {
    return absl::InvalidArgumentError(
        "shard call: hidden, weight, targets and stats must not be null");
  }
  if (args.stats_chunk_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard call: stats_chunk_rows must be >= 1, got ", args.stats_chunk_rows));
  }
  if (args.workspace == nullptr && args.workspace_bytes > 0) {
    return absl::InvalidArgumentError("shard call: workspace is null but workspace_bytes > 0");
  }
  if (absl::Status status = ValidateTopK(args, shard.problem.v); !status.ok()) return status;
  if (AsksDistributionOutputs(args) && args.output_stats == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard call: output_stats must not be null when ",
                     RequestedDistributionOutputs(args), " is asked for"));
  }
  if (args.output_stats != nullptr &&
      (args.top_k < 0 || args.top_k > kMaxTopK || args.top_k > shard.problem.v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard call: top_k must be in [0, ", kMaxTopK, "] and at most v (",
                     shard.problem.v, ") when output_stats is given, got ", args.top_k));
  }
  if (absl::Status status = ValidateLossInputs(shard.problem, TermPointersOf(args));
      !status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("shard call: ", status.message()));
  }
  // The entropy term combines s over the shards, which travels in output_stats.
  if (shard.problem.options.entropy_coef != 0.0f && args.output_stats == nullptr) {
    return absl::InvalidArgumentError(
        "shard call: output_stats must not be null when entropy_coef is not 0");
  }
  if (args.grad_stash.data != nullptr) {
    if (args.grad_weight != nullptr) {
      return absl::InvalidArgumentError(
          "shard call: grad_weight must be null when grad_stash is given");
    }
    return ValidateGradStash(args.grad_stash, shard.problem.n);
  }
  return absl::OkStatus();
}

absl::Status ValidateShardChunk(const ShardProblem& shard, const ShardArguments& args,
                                ShardChunk chunk) {
  if (absl::Status status = ValidateShardArguments(shard, args); !status.ok()) return status;
  if (chunk.size < 1 || chunk.begin < 0 || chunk.begin > shard.problem.n - chunk.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard chunk [", chunk.begin, ", ", chunk.begin + chunk.size,
                     ") must be a non-empty part of [0, ", shard.problem.n, ")"));
  }
  if (chunk.size > args.stats_chunk_rows) {
    return absl::InvalidArgumentError(absl::StrCat("shard chunk of ", chunk.size,
                                                   " tokens is larger than stats_chunk_rows (",
                                                   args.stats_chunk_rows, ")"));
  }
  return absl::OkStatus();
}

int64_t BalancedChunkRows(int64_t n, int64_t max_rows) {
  if (max_rows < 1 || n <= max_rows) return std::max<int64_t>(std::min(n, max_rows), 1);
  const int64_t chunks = (n + max_rows - 1) / max_rows;
  const int64_t even = (n + chunks - 1) / chunks;
  const int64_t rounded = (even + 127) / 128 * 128;
  return rounded <= max_rows ? rounded : even;
}

namespace {

absl::Status NoShards(const Backend& backend) {
  return absl::UnimplementedError(
      absl::StrCat("the ", backend.name(), " backend cannot run a vocabulary shard"));
}

}  // namespace

absl::StatusOr<ShardPlan> Backend::PlanShard(const ShardProblem&, size_t) const {
  return NoShards(*this);
}
absl::Status Backend::ShardBegin(const ShardProblem&, const ShardArguments&, Stream&) {
  return NoShards(*this);
}
absl::Status Backend::ShardForward(const ShardProblem&, const ShardArguments&, ShardChunk,
                                   Stream&) {
  return NoShards(*this);
}
absl::Status Backend::ShardBackward(const ShardProblem&, const ShardArguments&, ShardChunk,
                                    Stream&) {
  return NoShards(*this);
}
absl::Status Backend::ShardStoreGradHidden(const ShardProblem&, const float*, ShardChunk, void*,
                                           Stream&) {
  return NoShards(*this);
}

}  // namespace losshead::kernels
