// One micro-batch through the vocabulary-shard entry points of k backends, the sequence that
// shard_problem.h describes, with every output brought back to the host: the sharded counterpart
// of RunOnBackend, for comparing a sharded run against an unsharded one.
#ifndef LOSSHEAD_TESTS_KERNELS_SHARD_RUNNER_H_
#define LOSSHEAD_TESTS_KERNELS_SHARD_RUNNER_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "tests/kernels/backend_runner.h"

namespace losshead::kernels::testing {

// Deferred dW on every shard (ShardArguments::grad_stash): per shard, a stash of `capacity` token
// rows laid out for ShardStashShape and that shard's rows of dW, kept across calls.
struct ShardStashes {
  int64_t capacity = 0;
  int64_t tokens = 0;                     // rows in use, the same on every shard
  std::vector<DeviceBuffer> stash;        // per shard
  std::vector<DeviceBuffer> grad_weight;  // per shard, its rows x D fp32
};

// Shard r runs on shards[r] with rows ShardRange(V, k, r). The statistics and the dH partials are
// exchanged with `collective` (AllGather, AllReduce) when given, else through the host: copied
// out, gathered or summed in rank order in double, copied back (so that shards on one device, or
// backends without a collective, can run too). The chunk size is the smallest of the shards'
// plans for options.workspace_budget, balanced (BalancedChunkRows) as the server runs it. dW is the
// shards' rows, concatenated (V x D). With `stashes`, each shard leaves G and H in its stash's
// next rows instead (stashes->tokens grows by n; the caller flushes), and dW is not returned.
absl::StatusOr<Outputs> RunSharded(std::span<Backend* const> shards, Collective* collective,
                                   const Inputs& inputs, const RunOptions& options = {},
                                   ShardStashes* stashes = nullptr);

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_SHARD_RUNNER_H_
