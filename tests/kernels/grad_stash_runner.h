// Test helper for deferred dW (losshead/kernels/grad_stash.h): a sequence of micro-batches run
// through one gradient stash on a backend, flushed into dW whenever the next one would not fit
// and at the end, with every output brought back to the host.
#ifndef LOSSHEAD_TESTS_KERNELS_GRAD_STASH_RUNNER_H_
#define LOSSHEAD_TESTS_KERNELS_GRAD_STASH_RUNNER_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"
#include "tests/kernels/backend_runner.h"

namespace losshead::kernels::testing {

struct StashedRun {
  std::vector<Outputs> microbatches;  // each one's loss, token count and dH (no grad_weight)
  std::vector<float> grad_weight;     // dW (from zeros) after the last flush
  int flushes = 0;                    // FlushGradStash calls that had tokens to add
};

// Runs `batches` (one shape, one W: batches[0]'s) in order on one stream into a stash of
// `capacity` tokens (every batch at most that large).
absl::StatusOr<StashedRun> RunStashed(Backend& backend, const std::vector<Inputs>& batches,
                                      int64_t capacity, size_t workspace_budget = size_t{64} << 20);

// The same through the vocabulary shards of one head (RunSharded with ShardStashes, the
// statistics and dH partials exchanged through the host): every shard stashes into a stash of
// `capacity` tokens of its own, flushed into its rows of dW whenever the next micro-batch would
// not fit and at the end. dW is the shards' rows, concatenated (V x D). Each micro-batch runs
// with `options` where given (its workspace_budget, outputs and loss terms' inputs, which must
// fit every batch), else with the budget alone and no per-token outputs.
absl::StatusOr<StashedRun> RunShardedStashed(std::span<Backend* const> shards,
                                             const std::vector<Inputs>& batches, int64_t capacity,
                                             size_t workspace_budget = size_t{64} << 20,
                                             const RunOptions* options = nullptr);

}  // namespace losshead::kernels::testing

#endif  // LOSSHEAD_TESTS_KERNELS_GRAD_STASH_RUNNER_H_
