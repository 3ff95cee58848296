// Page-locked host buffers for micro-batches being received, recycled. Hidden states assembled in
// page-locked memory go to the device in one asynchronous copy at the bus rate; assembled in
// ordinary memory they would first be copied into the I/O slot's page-locked staging, on the path
// between a micro-batch's arrival and its run. Page-locking is slow (the driver pins every page),
// so buffers are kept for reuse up to an idle bound, the least recently used leaving first.
// Thread-safe.
//
// A backend without page-locked memory (the CPU backend) makes Take return an empty buffer: the
// receiver then assembles in ordinary memory, as it would when an allocation fails.
#ifndef LOSSHEAD_SERVER_ENGINE_PINNED_POOL_H_
#define LOSSHEAD_SERVER_ENGINE_PINNED_POOL_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "losshead/kernels/backend.h"

namespace losshead::server {

class PinnedPool;

// A buffer taken from a PinnedPool, filled front to back; given back when destroyed. Move-only.
class PinnedBytes {
 public:
  PinnedBytes() = default;
  PinnedBytes(PinnedBytes&&) noexcept = default;
  PinnedBytes& operator=(PinnedBytes&& other) noexcept;
  PinnedBytes(const PinnedBytes&) = delete;
  PinnedBytes& operator=(const PinnedBytes&) = delete;
  ~PinnedBytes() { Reset(); }

  explicit operator bool() const { return buffer_.data() != nullptr; }
  size_t size() const { return size_; }
  size_t capacity() const { return buffer_.bytes(); }
  absl::string_view view() const { return absl::string_view(buffer_.data(), size_); }
  // Appends `bytes`; false, and nothing appended, when they do not fit.
  bool Append(absl::string_view bytes);
  // Makes room for `bytes` more at the end and returns where they go, for the caller to fill
  // (a copy out of a device, straight into page-locked memory) before anything reads them; null,
  // and nothing changed, when they do not fit.
  char* Extend(size_t bytes);
  // Gives the buffer back to its pool; the object is empty afterwards.
  void Reset();

 private:
  friend class PinnedPool;
  PinnedBytes(std::shared_ptr<PinnedPool> pool, kernels::HostBuffer buffer)
      : pool_(std::move(pool)), buffer_(std::move(buffer)) {}

  std::shared_ptr<PinnedPool> pool_;
  kernels::HostBuffer buffer_;
  size_t size_ = 0;
};

class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  using Allocate = std::function<absl::StatusOr<kernels::HostBuffer>(size_t)>;

  // `allocate` is the backend's AllocateHost; at most `max_idle_bytes` of buffers are kept idle.
  static std::shared_ptr<PinnedPool> Create(Allocate allocate, size_t max_idle_bytes);

  // An empty buffer with room for at least `bytes` (rounded up to whole MiB when allocated
  // afresh): the smallest idle one that fits, or a new one. A larger buffer is used rather than
  // a new one allocated: page-locking and freeing are slow (freeing may wait for the device), and
  // what the pool holds is bounded anyway (idle bound plus the bytes admission lets in). Empty
  // (false) when the backend has no page-locked memory or the allocation fails.
  PinnedBytes Take(size_t bytes);

  size_t idle_bytes() const;
  // Page-locked bytes held now, idle or in use.
  size_t held_bytes() const;

 private:
  friend class PinnedBytes;
  PinnedPool(Allocate allocate, size_t max_idle_bytes)
      : allocate_(std::move(allocate)), max_idle_bytes_(max_idle_bytes) {}
  void Give(kernels::HostBuffer buffer);

  const Allocate allocate_;
  const size_t max_idle_bytes_;
  mutable absl::Mutex mu_;
  std::vector<kernels::HostBuffer> idle_ ABSL_GUARDED_BY(mu_);  // least recently used first
  size_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool unsupported_ ABSL_GUARDED_BY(mu_) = false;  // the backend said UNIMPLEMENTED once
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_PINNED_POOL_H_
