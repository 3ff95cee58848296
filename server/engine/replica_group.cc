#include "server/engine/replica_group.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace losshead::server {

Replica::~Replica() {
  // Work still queued on the stream must finish before the buffers it uses are freed (the slots'
  // streams wait for their own work when they are destroyed).
  if (stream != nullptr) stream->Synchronize().IgnoreError();
}

absl::StatusOr<std::unique_ptr<ReplicaGroup>> ReplicaGroup::Create(
    std::span<kernels::Backend* const> devices, int64_t vocab_size, int64_t hidden_size,
    kernels::DType dtype, Holding holding, kernels::MatmulPrecision precision,
    std::shared_ptr<kernels::ProcessGroup> processes) {
  const int k = static_cast<int>(devices.size());
  if (k < 1) return absl::InvalidArgumentError("a head needs at least one device");
  for (int r = 0; r < k; ++r) {
    if (devices[r] == nullptr) return absl::InvalidArgumentError("null device");
  }
  std::unique_ptr<ReplicaGroup> group(new ReplicaGroup(vocab_size, hidden_size, dtype, precision));
  group->shard_count_ = k;
  if (processes != nullptr) {
    if (holding != Holding::kOwnRows) {
      return absl::InvalidArgumentError("only a sharded head spans processes");
    }
    // The collective first: it tells every process its shards' global ranks. Every process
    // reaches it (the checks above are the same on every process for the same spec).
    LOSSHEAD_ASSIGN_OR_RETURN(group->collective_,
                              kernels::CreateProcessCollective(processes, devices));
    group->shard_count_ = group->collective_->size();
    group->first_shard_ = group->collective_->first_rank();
    group->across_processes_ = true;
    // Where each process's shards begin, so that a micro-batch's hidden states can be sent from
    // the first shard of the process that received them.
    const int32_t mine = group->first_shard_;
    LOSSHEAD_ASSIGN_OR_RETURN(
        const std::vector<std::vector<std::byte>> firsts,
        processes->AllGather("the first shard of every process",
                             std::as_bytes(std::span<const int32_t>(&mine, 1))));
    group->process_ = processes->rank();
    group->process_first_shards_.clear();
    for (const std::vector<std::byte>& first : firsts) {
      int32_t rank = 0;
      std::memcpy(&rank, first.data(), sizeof(rank));
      group->process_first_shards_.push_back(rank);
    }
  }
  const int shards = group->shard_count_;
  if (vocab_size < shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("a head of ", vocab_size, " rows cannot be ",
                     holding == Holding::kOwnRows ? "sharded" : "replicated", " over ", shards,
                     " devices: each owns at least one row"));
  }
  for (int r = 0; r < k; ++r) {
    const kernels::Shard rows = kernels::ShardRange(vocab_size, shards, group->first_shard_ + r);
    const kernels::Shard held =
        holding == Holding::kOwnRows ? rows : kernels::Shard{.begin = 0, .end = vocab_size};
    auto replica = std::make_unique<Replica>(*devices[r], r, rows, held);
    absl::MutexLock lock(&replica->slots_mu);
    for (size_t i = 0; i < Replica::kIoSlots; ++i) {
      replica->free_slots.push_back(std::make_unique<IoSlot>());
    }
    group->replicas_.push_back(std::move(replica));
  }
  if (k > 1 && group->collective_ == nullptr) {
    LOSSHEAD_ASSIGN_OR_RETURN(group->collective_, kernels::CreateCollective(devices));
  }
  return group;
}

ReplicaGroup::~ReplicaGroup() {
  if (idle_flush_.joinable()) {
    stop_idle_flush_.Notify();
    idle_flush_.join();
  }
  Synchronize().IgnoreError();
}

void ReplicaGroup::StartIdleFlush(absl::Duration idle) {
  if (idle_flush_.joinable()) return;
  const int64_t idle_ns = absl::ToInt64Nanoseconds(idle);
  // Looks twice per idle period, at most every 0.25 ms: a few wake-ups per millisecond per head.
  const absl::Duration poll = std::max(idle / 2, absl::Microseconds(250));
  idle_flush_ = std::thread([this, idle_ns, poll] {
    std::vector<Replica*> idle;
    while (!stop_idle_flush_.WaitForNotificationWithTimeout(poll)) {
      idle.clear();
      for (const auto& r : replicas_) {
        if (r->stashed_tokens.load() == 0 || r->queued_tokens.load() != 0) continue;
        if (absl::GetCurrentTimeNanos() - r->last_run_end_ns.load() < idle_ns) continue;
        // A micro-batch or a cut holding the lock has work of its own: look again later.
        if (!r->compute_mu.TryLock()) continue;
        if (r->queued_tokens.load() == 0) {
          idle.push_back(r.get());
        } else {
          r->compute_mu.Unlock();
        }
      }
      // Together: a sharded head's shards go idle at once. A failure is kept in stash_fault for
      // the next cut to answer.
      FlushStashes(idle).IgnoreError();
      for (Replica* r : idle) r->compute_mu.Unlock();
    }
  });
}

absl::Status ReplicaGroup::FlushStash(Replica& r) {
  Replica* const one[] = {&r};
  return FlushStashes(one);
}

absl::Status ReplicaGroup::FlushStashes(std::span<Replica* const> replicas) {
  // The stashed tokens of each flush launched (0 where a replica had none), and its launch.
  std::vector<int64_t> tokens(replicas.size(), 0);
  std::vector<absl::Status> flushed(replicas.size());
  for (size_t i = 0; i < replicas.size(); ++i) {
    Replica& r = *replicas[i];
    if (r.stash_tokens == 0) continue;
    // The stash adds to the rows the device holds as a head of that many rows (a shard's stash
    // holds its columns of G).
    const kernels::Problem shape{
        .n = 1, .d = hidden_size_, .v = DeviceRows(r), .dtype = dtype_, .precision = precision_};
    const kernels::GradStash stash{
        .data = r.stash.data(), .capacity = r.stash_capacity, .tokens = r.stash_tokens};
    tokens[i] = r.stash_tokens;
    r.stash_tokens = 0;
    r.stashed_tokens = 0;
    flushed[i] = r.backend.FlushGradStash(shape, stash, r.grad.as<float>(), r.workspace.data(),
                                          r.workspace.bytes(), *r.stream);
  }
  absl::Status result;
  for (size_t i = 0; i < replicas.size(); ++i) {
    if (tokens[i] == 0) continue;
    Replica& r = *replicas[i];
    if (flushed[i].ok()) flushed[i] = r.stream->Synchronize();
    if (flushed[i].ok()) continue;
    r.stash_fault = absl::DataLossError(absl::StrCat(
        "the device failed while adding ", tokens[i], " tokens of counted micro-batches to dW on ",
        r.backend.device_description(), ": ", flushed[i].message(),
        "; the gradient window's counters count them but dW lacks them, wholly or in part: pull "
        "with reset to drop the window before the next optimizer step"));
    result.Update(r.stash_fault);
  }
  return result;
}

Replica& ReplicaGroup::Next() {
  const int k = size();
  const int start = static_cast<int>(next_tie_.fetch_add(1, std::memory_order_relaxed) % k);
  Replica* best = replicas_[start].get();
  for (int i = 1; i < k; ++i) {
    Replica* r = replicas_[(start + i) % k].get();
    if (r->queued_tokens.load() < best->queued_tokens.load()) best = r;
  }
  return *best;
}

ReplicaGroup::DeviceLocks::DeviceLocks(std::span<Replica* const> devices) : devices_(devices) {
  for (Replica* replica : devices_) replica->compute_mu.Lock();
}

ReplicaGroup::DeviceLocks::~DeviceLocks() {
  for (auto it = devices_.rbegin(); it != devices_.rend(); ++it) (*it)->compute_mu.Unlock();
}

ReplicaGroup::Cut::Cut(const ReplicaGroup& group) : group_(group) {
  for (const auto& replica : group_.replicas_) replica->compute_mu.Lock();
  // No run launches while the locks are held; those in flight finish and count without them.
  for (const auto& replica : group_.replicas_) {
    absl::MutexLock flight(&replica->flight_mu);
    replica->flight_mu.Await(absl::Condition(
        +[](int* in_flight) { return *in_flight == 0; }, &replica->runs_in_flight));
  }
}

ReplicaGroup::Cut::~Cut() {
  for (auto it = group_.replicas_.rbegin(); it != group_.replicas_.rend(); ++it) {
    (*it)->compute_mu.Unlock();
  }
}

std::vector<void*> ReplicaGroup::Buffers(kernels::DeviceBuffer Replica::*tensor) const {
  std::vector<void*> buffers;
  for (const auto& replica : replicas_) buffers.push_back(((*replica).*tensor).data());
  return buffers;
}

std::vector<kernels::Stream*> ReplicaGroup::Streams() const {
  std::vector<kernels::Stream*> streams;
  for (const auto& replica : replicas_) streams.push_back(replica->stream.get());
  return streams;
}

size_t ReplicaGroup::ReleaseStash(Replica& r) {
  FlushStash(r).IgnoreError();  // kept in stash_fault: the next cut answers it
  r.stash_wanted = r.stash_wanted || r.stash_capacity != -1;
  r.stash_capacity = -1;
  const size_t bytes = r.stash.bytes();
  r.stash.Reset();
  r.stash_held = 0;
  r.scratch_bytes -= bytes;
  return bytes;
}

absl::Status ReplicaGroup::DiscardGradient() {
  for (const auto& r : replicas_) {
    const size_t bytes = static_cast<size_t>(DeviceRows(*r)) * hidden_size_ * sizeof(float);
    LOSSHEAD_RETURN_IF_ERROR(r->backend.Memset(r->grad.data(), 0, bytes, *r->stream));
  }
  LOSSHEAD_RETURN_IF_ERROR(Synchronize());
  // The stashed rows are simply forgotten: the next micro-batch writes over them.
  for (const auto& r : replicas_) {
    r->stash_tokens = 0;
    r->stashed_tokens = 0;
    r->stash_fault = absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::Status ReplicaGroup::FlushAllStashes() {
  absl::Status fault;
  std::vector<Replica*> all;
  for (const auto& r : replicas_) {
    // A fault from an earlier flush first: this cut is the one that answers it.
    fault.Update(std::exchange(r->stash_fault, absl::OkStatus()));
    all.push_back(r.get());
  }
  fault.Update(FlushStashes(all));
  for (const auto& r : replicas_) r->stash_fault = absl::OkStatus();  // answered now
  return fault;
}

absl::Status ReplicaGroup::ReduceGradientToOwners() {
  LOSSHEAD_RETURN_IF_ERROR(FlushAllStashes());
  if (collective_ == nullptr) return absl::OkStatus();
  const std::vector<int64_t> counts = kernels::ShardCounts(vocab_size_, size(), hidden_size_);
  LOSSHEAD_RETURN_IF_ERROR(collective_->ReduceScatter(Buffers(&Replica::grad), counts,
                                                      kernels::DType::kFP32, Streams()));
  // The rows a replica does not own still hold its own contributions, now counted in their
  // owner's sum.
  for (const auto& r : replicas_) {
    float* grad = r->grad.as<float>();
    const int64_t begin = RowOffset(*r);
    const int64_t end = begin + RowElements(*r);
    const int64_t total = vocab_size_ * hidden_size_;
    if (begin > 0) {
      LOSSHEAD_RETURN_IF_ERROR(r->backend.Memset(grad, 0, begin * sizeof(float), *r->stream));
    }
    if (end < total) {
      LOSSHEAD_RETURN_IF_ERROR(
          r->backend.Memset(grad + end, 0, (total - end) * sizeof(float), *r->stream));
    }
  }
  return absl::OkStatus();
}

absl::Status ReplicaGroup::BroadcastWeights() {
  if (collective_ == nullptr) return absl::OkStatus();
  return collective_->Broadcast(Buffers(&Replica::weights), vocab_size_ * hidden_size_, dtype_,
                                /*root=*/0, Streams());
}

absl::Status ReplicaGroup::GatherWeights() {
  if (collective_ == nullptr) return absl::OkStatus();
  return collective_->AllGather(Buffers(&Replica::weights),
                                kernels::ShardCounts(vocab_size_, size(), hidden_size_), dtype_,
                                Streams());
}

absl::Status ReplicaGroup::GatherShardStats(int64_t chunk_rows, int output_stats_rows) {
  if (collective_ == nullptr) return absl::OkStatus();
  // One slice per shard of every process (the collective's ranks).
  const std::vector<int64_t> counts(collective_->size(), kernels::kShardStats * chunk_rows);
  LOSSHEAD_RETURN_IF_ERROR(collective_->AllGather(Buffers(&Replica::shard_stats), counts,
                                                  kernels::DType::kFP32, Streams()));
  if (output_stats_rows == 0) return absl::OkStatus();
  // int32 ids travel as the floats with their bits: a gather copies them, never adds.
  const std::vector<int64_t> output_counts(collective_->size(),
                                           int64_t{output_stats_rows} * chunk_rows);
  return collective_->AllGather(Buffers(&Replica::shard_output_stats), output_counts,
                                kernels::DType::kFP32, Streams());
}

absl::Status ReplicaGroup::SumShardPartials(int64_t floats, int root) {
  if (collective_ == nullptr) return absl::OkStatus();
  return collective_->Reduce(Buffers(&Replica::shard_partial), floats, kernels::DType::kFP32, root,
                             Streams());
}

absl::Status ReplicaGroup::BroadcastShards(std::span<void* const> buffers, int64_t elements,
                                           kernels::DType dtype, int root) {
  if (collective_ == nullptr) return absl::OkStatus();
  return collective_->Broadcast(buffers, elements, dtype, root, Streams());
}

absl::Status ReplicaGroup::Synchronize() {
  absl::Status first;
  for (const auto& replica : replicas_) {
    if (replica->stream != nullptr) first.Update(replica->stream->Synchronize());
  }
  return first;
}

}  // namespace losshead::server
