// One device's part of a vocabulary-sharded problem: the fused linear + cross-entropy over k
// devices, device i holding rows [row_begin, row_begin + rows) of W (ShardRange(V, k, i)).
//
// The softmax of a token spans every shard, so each token chunk runs in two halves around an
// exchange of per-token statistics, which the caller drives over all shards (with a Collective):
//
//   ShardBegin        once per micro-batch: token count, gradient scale, loss accumulator
//   per chunk of tokens [t0, t0 + c):
//     ShardForward    logits of the shard's rows; per token, over the soft-capped z, its row
//                     max m, sum of exp(z - m), sum of z, and z of the target where the target is
//                     one of its rows (0 elsewhere): four fp32 statistics, into its slice of
//                     `stats`; with output_stats, also those of the distribution outputs
//                     (kShardOutputStats), into its slice of output_stats
//     AllGather       of the statistics, so that every shard holds every shard's slice (and of
//                     output_stats, when a distribution output is asked for)
//     ShardBackward   combines the slices in rank order into each token's lse and loss (the same
//                     bits on every shard); writes the loss outputs where given, and the
//                     distribution outputs (problem.h) where asked for; G for its columns
//                     (global lse, its own one-hot and label-smoothing terms); its part of the
//                     chunk's dH, G . W_rows, in fp32 into `grad_hidden_partial`; dW_rows += G^T H,
//                     or with a gradient stash, G (scaled) and H into the stash's next rows
//     AllReduce(kSum) of the dH partials
//     ShardStoreGradHidden  the summed fp32 dH rounded to the problem's dtype into grad_hidden
//
// The logits of a chunk stay in the workspace from ShardForward to ShardBackward: the two calls
// of a chunk use one workspace, on one stream, with no other Run or shard call between them.
#ifndef LOSSHEAD_KERNELS_SHARD_PROBLEM_H_
#define LOSSHEAD_KERNELS_SHARD_PROBLEM_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "losshead/kernels/grad_stash.h"
#include "losshead/kernels/problem.h"

namespace losshead::kernels {

// Statistics per token and shard (see the file comment), in this order.
inline constexpr int kShardStats = 4;

struct ShardProblem {
  Problem problem;  // the whole problem: n tokens of the micro-batch, v the whole vocabulary
  int64_t row_begin = 0;
  int64_t rows = 0;
  int shards = 1;  // k
  int rank = 0;    // this shard's slice of the statistics
};

// INVALID_ARGUMENT for an invalid problem, rows outside [0, v) or empty, k < 1 or a rank outside
// [0, k).
absl::Status ValidateShardProblem(const ShardProblem& shard);

// The shape of a shard's gradient stash: the problem with the shard's rows as its vocabulary. A
// shard's stash is sized (Backend::GradStashBytes) and flushed into its rows of dW
// (Backend::FlushGradStash) with it, as an unsharded head of that many rows would be.
inline Problem ShardStashShape(const ShardProblem& shard) {
  Problem shape = shard.problem;
  shape.v = shard.rows;
  return shape;
}

// How a backend splits a shard's micro-batch: chunks of at most `chunk_rows` tokens.
//   workspace_bytes    the backend's own scratch (Arguments::workspace's counterpart)
//   stats_floats       k * kShardStats * chunk_rows: the `stats` buffer every shard holds
//   partial_floats     chunk_rows * d: the `grad_hidden_partial` buffer
// workspace + stats + partial fit the budget the plan was made for. The chunk size depends on the
// problem (not on rank or row_begin) and the budget, so shards of one head with the same budget
// and sizes within one row get plans whose smallest chunk_rows serves them all.
struct ShardPlan {
  int64_t chunk_rows = 0;
  size_t workspace_bytes = 0;
  int64_t stats_floats = 0;
  int64_t partial_floats = 0;
};

// The chunk size a caller should run n tokens in when a plan allows up to `max_rows`: the fewest
// chunks, all of one size (rounded up to a multiple of 128 tokens where that still fits), so that
// no short tail chunk pays a whole pass over the shard's fp32 dW for a few tokens. At most
// max_rows; n when it fits whole.
int64_t BalancedChunkRows(int64_t n, int64_t max_rows);

// Pointers for one shard's calls; every buffer in that backend's memory.
struct ShardArguments {
  const void* hidden = nullptr;      // N x D, problem.dtype: the whole micro-batch
  const void* weight = nullptr;      // rows x D, problem.dtype: this shard's rows
  const int32_t* targets = nullptr;  // N, in [0, V) or ignore_index
  float* grad_weight = nullptr;      // rows x D fp32, accumulated into (+=); optional
  // Deferred dW (grad_stash.h), instead of grad_weight: ShardBackward leaves the chunk's G, scaled,
  // and its H in the stash's rows [tokens + chunk.begin, tokens + chunk.begin + chunk.size), the
  // stash laid out for ShardStashShape(shard) and holding the whole micro-batch.
  GradStash grad_stash;
  // chunk_rows x D fp32, this shard's part of the chunk's dH; null: no dH (forward only or
  // skip_grad_hidden).
  float* grad_hidden_partial = nullptr;
  // kShardStats x chunk_rows fp32 per shard, k slices in rank order, each statistic a row of
  // chunk_rows floats: ShardForward writes slice `rank`, ShardBackward reads all k.
  float* stats = nullptr;
  int64_t stats_chunk_rows = 0;  // the plan's chunk_rows, the stride of `stats`
  // Outputs of the whole micro-batch, optional (one shard writes them): loss_sum (over the chunks
  // so far, fp64 accumulated), token_count (ShardBegin), per-token loss and lse (N each).
  float* loss_sum = nullptr;
  int64_t* token_count = nullptr;
  float* per_token_loss = nullptr;
  float* per_token_lse = nullptr;
  // The distribution outputs, as Arguments defines them (problem.h), of the whole micro-batch
  // (one shard writes them; correct_count is zeroed by ShardBegin and counts the chunks so far).
  // They need more statistics per token and shard, exchanged beside `stats`: see output_stats.
  float* per_token_logprob = nullptr;
  float* per_token_entropy = nullptr;
  int32_t* per_token_argmax = nullptr;
  int64_t* correct_count = nullptr;
  // The model options' and loss terms' inputs and outputs, as Arguments defines them (problem.h),
  // bias and grad_bias over this shard's rows (grad_bias accumulated over the chunks), the
  // per-token inputs over the micro-batch and given to EVERY shard (each forms its own columns'
  // G from them). The entropy term needs s, which travels in output_stats: a problem with
  // entropy_coef != 0 needs output_stats on every shard. Both backends compute them.
  const float* bias = nullptr;
  float* grad_bias = nullptr;
  const float* token_weights = nullptr;
  const float* old_logprob = nullptr;
  const float* advantages = nullptr;
  const float* ref_logprob = nullptr;
  // As Arguments::top_k, but read by every shard whenever output_stats is given: the shards of
  // one call pass the same top_k (0 when the top-k is not asked for), which sizes output_stats.
  int32_t top_k = 0;
  int32_t* top_k_ids = nullptr;
  float* top_k_logprobs = nullptr;
  // ShardOutputStatsRows(top_k) x stats_chunk_rows fp32 per shard, k slices in rank order as
  // `stats`, given on EVERY shard when the shard that writes the outputs asks for any (and on
  // none otherwise: nothing extra is computed or exchanged then). ShardForward writes slice
  // `rank`, the caller all-gathers it as it does `stats`, ShardBackward reads all k. Outside the
  // plan's budget: at most k * (2 + 2 kMaxTopK) floats per token of a chunk.
  float* output_stats = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// The statistics per token and shard behind the distribution outputs (ShardArguments::
// output_stats), each a row of stats_chunk_rows floats, in this order:
//   0                 s = sum_j ShiftedZTerm(e_j, z_j - m) over the shard's columns, against its
//                     max m (stat 0 of `stats`); combined over shards with RescaledShiftedZ
//   1                 the global id of the shard's argmax (its z is m), int32 bits in the float;
//                     combined over shards with ArgmaxBeats
//   2 .. 2 + k        with top-k: z of the shard's top_k candidates, in top-k order
//   2 + k .. 2 + 2k   their global ids, int32 bits (-1 past a shard with fewer than k columns)
// An int32 travels through the gather as the float with its bits: AllGather copies, never adds.
inline constexpr int kShardOutputStats = 2;

// Rows of output_stats per shard for a call with this top_k (0: no top-k).
inline constexpr int ShardOutputStatsRows(int top_k) { return kShardOutputStats + 2 * top_k; }

// Tokens [begin, begin + size) of the micro-batch; size <= the plan's chunk_rows.
struct ShardChunk {
  int64_t begin = 0;
  int64_t size = 0;
};

// What every backend checks of a call's pointers (INVALID_ARGUMENT naming the field): hidden,
// weight, targets and stats not null, stats_chunk_rows >= 1, a workspace when workspace_bytes > 0,
// output_stats when a distribution output is asked for or entropy_coef != 0, top_k in
// [0, min(kMaxTopK, v)] when output_stats is given ([1, ...] when the top-k is asked for,
// ValidateTopK), and the loss terms' pointers against the options (ValidateLossInputs).
absl::Status ValidateShardArguments(const ShardProblem& shard, const ShardArguments& args);
// And of a chunk: non-empty, inside [0, n), at most stats_chunk_rows tokens.
absl::Status ValidateShardChunk(const ShardProblem& shard, const ShardArguments& args,
                                ShardChunk chunk);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_SHARD_PROBLEM_H_
