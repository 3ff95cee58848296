#include "server/engine/device_scratch.h"

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "server/engine/host_tensors.h"

namespace losshead::server {
namespace {

// The most tokens a gradient stash of at most `budget` bytes holds on `backend` (0: none, or the
// backend has no stash). Its bytes grow with its capacity, alignment padding included, so a
// bisection finds the exact largest.
int64_t StashCapacity(const kernels::Backend& backend, const kernels::Problem& problem,
                      size_t budget) {
  auto fits = [&](int64_t capacity) {
    absl::StatusOr<size_t> bytes = backend.GradStashBytes(problem, capacity);
    return bytes.ok() && *bytes <= budget;
  };
  if (!fits(1)) return 0;
  // A token stashes its v gradients and d hidden values, at least a byte each.
  int64_t lo = 1;
  int64_t hi = static_cast<int64_t>(budget / static_cast<size_t>(problem.v + problem.d));
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace

void DeviceScratch::ReportReleased(size_t bytes) const {
  std::fprintf(stderr,
               "losshead-server: head '%s' gave its deferred-dW stash (%zu bytes) back for memory "
               "that something else needed; its micro-batches add to dW directly until a deleted "
               "head frees memory there (a smaller --grad_stash_bytes keeps a stash)\n",
               head_name_.c_str(), bytes);
}

absl::Status DeviceScratch::Ensure(Replica& replica, kernels::DeviceBuffer& buffer, size_t bytes,
                                   bool compute_locked) {
  if (buffer.bytes() >= bytes) return absl::OkStatus();
  const size_t old = buffer.bytes();
  buffer.Reset();  // free first: the old and new buffer need not fit together
  auto fresh = replica.backend.Allocate(bytes);
  if (absl::IsResourceExhausted(fresh.status())) {
    std::optional<absl::MutexLock> lock;
    if (!compute_locked) lock.emplace(&replica.compute_mu);
    const size_t stashed = replica.stash.bytes();
    const kernels::MemoryInfo memory = replica.backend.memory_info();
    // Only where that makes room: a buffer that would not fit even so leaves the stash be.
    if (stashed > 0 && (memory.total_bytes == 0 || bytes <= memory.free_bytes + stashed)) {
      ReportReleased(group_.ReleaseStash(replica));
      fresh = replica.backend.Allocate(bytes);
    }
  }
  // Then the other heads' stashes on the device, those that are idle.
  if (absl::IsResourceExhausted(fresh.status()) && take_back_ != nullptr &&
      take_back_(replica.backend, bytes) > 0) {
    fresh = replica.backend.Allocate(bytes);
  }
  if (!fresh.ok()) {
    replica.scratch_bytes -= old;
    return AsResourceExhausted(fresh.status(), "micro-batch buffers");
  }
  buffer = std::move(*fresh);
  replica.scratch_bytes += bytes - old;
  return absl::OkStatus();
}

absl::StatusOr<kernels::GradStash> DeviceScratch::StashFor(Replica& replica,
                                                           const kernels::Problem& problem) {
  // Memory was freed on this device since the stash gave way or did not fit: try again.
  if (replica.stash_capacity == -1 && replica.stash_retry.exchange(false) &&
      std::exchange(replica.stash_wanted, false)) {
    replica.stash_capacity = 0;
  }
  if (replica.stash_capacity == 0) {
    // First use on this device: the most tokens the budget holds, or none.
    replica.stash_capacity = -1;
    kernels::Backend& backend = replica.backend;
    const int64_t capacity = StashCapacity(backend, problem, stash_bytes_);
    if (capacity > 0) {
      const size_t bytes = *backend.GradStashBytes(problem, capacity);
      // A device short of memory runs without a stash, as before one existed.
      absl::StatusOr<kernels::DeviceBuffer> stash = backend.Allocate(bytes);
      if (stash.ok()) {
        replica.stash = std::move(*stash);
        replica.stash_capacity = capacity;
        replica.stash_held = bytes;
        replica.scratch_bytes += bytes;
      } else {
        replica.stash_wanted = true;
      }
    }
  }
  if (problem.n > replica.stash_capacity) return kernels::GradStash{};
  if (replica.StashFullFor(problem.n)) LOSSHEAD_RETURN_IF_ERROR(group_.FlushStash(replica));
  return kernels::GradStash{.data = replica.stash.data(),
                            .capacity = replica.stash_capacity,
                            .tokens = replica.stash_tokens};
}

void DeviceScratch::RetryStashes(const kernels::Backend* device) {
  for (const auto& r : group_.replicas()) {
    if (&r->backend == device) r->stash_retry = true;  // taken by the next micro-batch (StashFor)
  }
}

size_t DeviceScratch::StashBytes(const kernels::Backend* device) const {
  size_t bytes = 0;
  for (const auto& r : group_.replicas()) {
    if (&r->backend == device) bytes += r->stash_held.load();
  }
  return bytes;
}

size_t DeviceScratch::TryReleaseStashes(const kernels::Backend* device) {
  size_t released = 0;
  for (const auto& r : group_.replicas()) {
    // A replica at work keeps its stash: the caller holds compute locks of its own, so waiting
    // here for this one could deadlock.
    if (&r->backend != device || !r->compute_mu.TryLock()) continue;
    released += group_.ReleaseStash(*r);
    r->compute_mu.Unlock();
  }
  if (released > 0) ReportReleased(released);
  return released;
}

size_t DeviceScratch::ReleaseStashes(const kernels::Backend* device) {
  size_t released = 0;
  for (const auto& r : group_.replicas()) {
    if (&r->backend != device) continue;
    absl::MutexLock lock(&r->compute_mu);
    released += group_.ReleaseStash(*r);
  }
  if (released > 0) ReportReleased(released);
  return released;
}

absl::StatusOr<bool> DeviceScratch::EnsureStaging(Replica& replica, kernels::HostBuffer& buffer,
                                                  size_t bytes) {
  if (buffer.bytes() >= bytes) return true;
  buffer.Reset();
  absl::StatusOr<kernels::HostBuffer> fresh = replica.backend.AllocateHost(bytes);
  if (absl::IsUnimplemented(fresh.status())) return false;
  if (!fresh.ok()) return AsResourceExhausted(fresh.status(), "micro-batch staging memory");
  buffer = std::move(*fresh);
  return true;
}

}  // namespace losshead::server
