// Collectives over the devices of one process: what a head spread over several backends needs.
// A replicated head reduces its dW windows across replicas (AllReduce, or ReduceScatter for the
// ZeRO-1 optimizer, whose row shards are then gathered back with AllGather); a vocabulary-sharded
// head combines the shards' row max and sum of exponentials per token chunk (AllReduce kMax,
// kSum) and sums dH across shards (AllReduce). Broadcast copies W from one device to the others.
#ifndef LOSSHEAD_KERNELS_COLLECTIVE_H_
#define LOSSHEAD_KERNELS_COLLECTIVE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/problem.h"

namespace losshead::kernels {

enum class ReduceOp { kSum, kMax };

absl::string_view ReduceOpName(ReduceOp op);

// Indices [begin, end) of shard i when `total` rows (or elements) are split over k shards:
// [total * i / k, total * (i + 1) / k), rounded down. Sizes differ by at most one, every index
// has exactly one shard, and a vocabulary-sharded head holds rows ShardRange(V, k, i) on device i.
// Requires total >= 0, k >= 1 and 0 <= i < k.
struct Shard {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};
Shard ShardRange(int64_t total, int k, int i);

// Elements per rank when `rows` rows of `row_elements` elements each are split with ShardRange:
// the counts that ReduceScatter and AllGather take for W or dW (row_elements = D).
std::vector<int64_t> ShardCounts(int64_t rows, int k, int64_t row_elements = 1);

// Collectives over k ranks, rank r being the r-th backend given to CreateCollective (its device).
// A collective may span several processes (process_group.h): then this process drives the
// local_size() ranks first_rank(), ..., first_rank() + local_size() - 1 of the k, and passes
// buffers and streams for those only; counts, offsets and roots still speak of all k ranks. Within
// one process local_size() == size() and first_rank() == 0, so "one per rank" below means one per
// local rank. Every call takes one buffer and one stream per rank, as spans of length
// local_size() in rank order; it enqueues its work on those streams and returns without waiting for
// it, like Backend::Run: a rank's result is there once its stream has reached the call
// (Stream::Synchronize, or later work on that stream). A rank's buffer lives in its backend's
// memory (Backend::Allocate), its stream was made by that backend, and the buffers of different
// ranks do not overlap. A rank's collective and its other work on one stream are issued from one
// thread, or ordered by the caller, as for any Backend call.
//
// Every call validates first: buffer or stream spans of a length other than local_size(), counts
// spans of a length other than k, a negative count, a null buffer with elements to move, a null
// stream, a root outside [0, k), or a dtype / op the call does not take are INVALID_ARGUMENT with
// a message naming the call and the problem, and nothing is enqueued or touched. Reductions take
// fp32 (dW, softmax statistics, dH partial sums); copies (Broadcast, AllGather) take every DType
// (W in bf16, fp16 or fp32).
//
// Summation order: the host implementation adds in fp64 in rank order 0, 1, ..., k-1 and rounds
// to fp32 once, so its results are bit-exact against an fp64 reference summed in that order.
// NCCL adds in fp32 in its own order (ring or tree, chosen by size and topology): it agrees with
// the host to the rounding of k fp32 terms, and a rerun of the same call gives the same bits.
// kMax with a NaN among the inputs is NaN on the host and unspecified on NCCL.
//
// Thread-safe: concurrent calls are each enqueued whole, one after another, so every rank sees
// the collectives in the same order (as NCCL requires). The backends are referred to, not owned:
// they outlive the collective.
class Collective {
 public:
  virtual ~Collective() = default;
  Collective(const Collective&) = delete;
  Collective& operator=(const Collective&) = delete;

  // Number of ranks (k), over every process the collective spans.
  int size() const { return size_; }
  // Ranks this process drives: buffers and streams come as spans of this length.
  int local_size() const { return local_size_; }
  // Rank of this process's first local rank: local rank i is rank first_rank() + i.
  int first_rank() const { return first_rank_; }

  // In place: afterwards every rank's `count` elements hold op over all ranks' elements. fp32.
  absl::Status AllReduce(std::span<void* const> buffers, int64_t count, DType dtype, ReduceOp op,
                         std::span<Stream* const> streams);

  // In place, sum, fp32: afterwards rank `root`'s `count` elements hold the sum over all ranks'
  // elements (AllReduce's sum, in its order); every other rank's buffer is unspecified (it may
  // hold the sum too). Moves about half of AllReduce's bytes where only one rank needs the sum.
  absl::Status Reduce(std::span<void* const> buffers, int64_t count, DType dtype, int root,
                      std::span<Stream* const> streams);

  // In place, sum, fp32. Every rank's buffer holds the sum of `counts` elements, rank r's slice
  // starting at counts[0] + ... + counts[r-1]; slices may be uneven (ShardCounts). Afterwards rank
  // r's slice r holds the sum over all ranks of their slice r; every other slice of every buffer
  // keeps its contents.
  absl::Status ReduceScatter(std::span<void* const> buffers, std::span<const int64_t> counts,
                             DType dtype, std::span<Stream* const> streams);

  // In place, every DType. Same layout as ReduceScatter: rank r's slice r is copied into slice r
  // of every other rank, so that afterwards every buffer holds every rank's slice. Only slice r of
  // rank r is read.
  absl::Status AllGather(std::span<void* const> buffers, std::span<const int64_t> counts,
                         DType dtype, std::span<Stream* const> streams);

  // In place, every DType: rank `root`'s `count` elements are copied to every other rank.
  absl::Status Broadcast(std::span<void* const> buffers, int64_t count, DType dtype, int root,
                         std::span<Stream* const> streams);

 protected:
  explicit Collective(int size) : Collective(size, size, 0) {}
  Collective(int size, int local_size, int first_rank)
      : size_(size), local_size_(local_size), first_rank_(first_rank) {}

  // The implementations' halves of the calls above, entered with validated arguments and at least
  // one element to move; offsets[r] is where slice r starts (counts' prefix sums; counts and
  // offsets index all k ranks, buffers and streams the local ones). An implementation may refuse
  // further (memory or stream of the wrong device) before enqueuing.
  virtual absl::Status DoAllReduce(std::span<void* const> buffers, int64_t count, DType dtype,
                                   ReduceOp op, std::span<Stream* const> streams) = 0;
  virtual absl::Status DoReduceScatter(std::span<void* const> buffers,
                                       std::span<const int64_t> counts,
                                       std::span<const int64_t> offsets, DType dtype,
                                       std::span<Stream* const> streams) = 0;
  virtual absl::Status DoAllGather(std::span<void* const> buffers, std::span<const int64_t> counts,
                                   std::span<const int64_t> offsets, DType dtype,
                                   std::span<Stream* const> streams) = 0;
  virtual absl::Status DoBroadcast(std::span<void* const> buffers, int64_t count, DType dtype,
                                   int root, std::span<Stream* const> streams) = 0;
  // The sum everywhere by default (DoAllReduce), which Reduce's contract allows.
  virtual absl::Status DoReduce(std::span<void* const> buffers, int64_t count, DType dtype,
                                int /*root*/, std::span<Stream* const> streams) {
    return DoAllReduce(buffers, count, dtype, ReduceOp::kSum, streams);
  }

 private:
  const int size_;
  const int local_size_;
  const int first_rank_;
};

// The collective over `backends`, rank r being backends[r]: the host implementation when every
// backend is a CPU backend (the same one may appear more than once), NCCL when every one is a
// CUDA backend on a distinct device (one communicator per device, created here; NVLink multicast
// stays off), and the staged one (staged_collective.h: synchronous, through host memory; the
// sums are the host's) when k >= 2 CUDA backends all sit on one device, which runs a head placed
// over k ranks on one GPU. INVALID_ARGUMENT for no backends, a null one, a mix of kinds, a CUDA
// device repeated among distinct ones, missing (device_ordinal() < 0) or not visible;
// UNIMPLEMENTED for CUDA backends on distinct devices in a build without NCCL; INTERNAL when NCCL
// fails to create the communicators. A collective over the backends of several processes is
// CreateProcessCollective's (process_group.h).
absl::StatusOr<std::unique_ptr<Collective>> CreateCollective(std::span<Backend* const> backends);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_COLLECTIVE_H_
