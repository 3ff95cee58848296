// The part of a cut that crosses processes, for a head replicated across server processes
// (docs/multi-process.md): every process holds all of W and counts the micro-batches that ran
// there in its own gradient window, and a cut sums those windows over every process, so that a
// pull answers the window of the whole group and an optimizer step sees it, stepping the same W
// the same way on every process.
//
// The sum goes through the process collective over one CPU backend per process
// (CreateProcessCollective): each element is added in fp64 in process rank order and rounded to
// fp32 once, the same bits on every process. The counters (micro-batches, tokens, the weights
// versions they ran against) are gathered beside it.
//
// Contract: a collective sequence. Every process calls Sum for the same head in the same order
// (the leader sequences the cuts: server/rpc/group_control.h), under the head's cut; a process
// that is not there (died, stopped) makes the call UNAVAILABLE on the others within the group's
// op timeout, and breaks the group for good. Nothing a caller holds is written unless every
// exchange succeeded. Thread-safe (calls are serialised).
#ifndef LOSSHEAD_SERVER_ENGINE_PROCESS_WINDOW_H_
#define LOSSHEAD_SERVER_ENGINE_PROCESS_WINDOW_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/process_group.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::server {

class ProcessWindow {
 public:
  // A collective call: every process of `group` makes it once, at start.
  static absl::StatusOr<std::shared_ptr<ProcessWindow>> Create(
      std::shared_ptr<kernels::ProcessGroup> group);

  int rank() const { return group_->rank(); }
  int size() const { return group_->size(); }
  // OK while the group can exchange; the error that broke it otherwise (UNAVAILABLE).
  absl::Status health() const { return group_->health(); }

  // `values` (this process's window: dW's V x D fp32, then db's V for a head with an output
  // bias, in place) replaced by their sum over every process, and the counters of `summary`
  // (token and micro-batch counts summed, the weights versions' range widened) by the group's.
  // On error neither is touched.
  absl::Status Sum(std::span<float> values, v1::GradientSummary& summary);
  // The counters alone (a summary without dW).
  absl::Status SumCounters(v1::GradientSummary& summary);
  // `data` of process `root` copied into every other process's `data` (of the same size there).
  // On error `data` is not touched where it is not root's.
  absl::Status Broadcast(std::string& data, int root);
  // Every process's `mine`, by rank (kernels::GatherStatuses, serialised with the calls above).
  absl::StatusOr<std::vector<absl::Status>> GatherStatuses(absl::string_view what,
                                                           const absl::Status& mine);

  // For a head sharded across processes (Placement.across_processes), whose processes hold
  // disjoint rows. Every process's `mine` (of any length), indexed by process rank.
  absl::StatusOr<std::vector<std::string>> AllGather(absl::string_view what,
                                                     absl::string_view mine);
  // Bytes [begin, end) of `data` (this process's rows of a V x D tensor, the same size on every
  // process) copied into every other process's `data`, and theirs into this one's: afterwards
  // every process holds every process's rows. The ranges must not overlap. On error `data` is
  // not touched outside [begin, end).
  absl::Status GatherRows(absl::string_view what, std::string& data, size_t begin, size_t end);
  // One round of point-to-point transfers (kernels::ProcessGroup::Exchange), serialised with the
  // calls above: sends[q] to process q, recvs[q] filled from it, each byte count what the peer
  // sends or expects. For the rows of a head sharded across processes that only some processes
  // need (its embedding rows and embedding gradients: each row goes to or from its owner only).
  absl::Status Exchange(absl::string_view what, std::span<const std::span<const std::byte>> sends,
                        std::span<const std::span<std::byte>> recvs);
  // The group, for the collectives of a head sharded across processes (CreateProcessCollective).
  const std::shared_ptr<kernels::ProcessGroup>& group() const { return group_; }

 private:
  ProcessWindow(std::shared_ptr<kernels::ProcessGroup> group,
                std::unique_ptr<kernels::Backend> backend, std::unique_ptr<kernels::Stream> stream,
                std::unique_ptr<kernels::Collective> collective)
      : group_(std::move(group)),
        backend_(std::move(backend)),
        stream_(std::move(stream)),
        collective_(std::move(collective)) {}
  absl::StatusOr<v1::GradientSummary> GatherCounters(const v1::GradientSummary& mine)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<kernels::ProcessGroup> group_;
  absl::Mutex mu_;
  // Declared in this order so that the collective goes before the backend it refers to.
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<kernels::Stream> stream_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<kernels::Collective> collective_ ABSL_GUARDED_BY(mu_);
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_PROCESS_WINDOW_H_
