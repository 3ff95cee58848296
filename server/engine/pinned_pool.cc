#include "server/engine/pinned_pool.h"

#include <cstddef>
#include <cstring>
#include <utility>

#include "absl/status/status.h"

namespace losshead::server {

PinnedBytes& PinnedBytes::operator=(PinnedBytes&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = std::move(other.pool_);
    buffer_ = std::move(other.buffer_);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

bool PinnedBytes::Append(absl::string_view bytes) {
  if (bytes.size() > buffer_.bytes() - size_) return false;
  if (!bytes.empty()) std::memcpy(buffer_.data() + size_, bytes.data(), bytes.size());
  size_ += bytes.size();
  return true;
}

char* PinnedBytes::Extend(size_t bytes) {
  if (buffer_.data() == nullptr || bytes > buffer_.bytes() - size_) return nullptr;
  char* at = buffer_.data() + size_;
  size_ += bytes;
  return at;
}

void PinnedBytes::Reset() {
  if (pool_ != nullptr && buffer_.data() != nullptr) pool_->Give(std::move(buffer_));
  buffer_ = kernels::HostBuffer();
  pool_.reset();
  size_ = 0;
}

std::shared_ptr<PinnedPool> PinnedPool::Create(Allocate allocate, size_t max_idle_bytes) {
  return std::shared_ptr<PinnedPool>(new PinnedPool(std::move(allocate), max_idle_bytes));
}

PinnedBytes PinnedPool::Take(size_t bytes) {
  if (bytes == 0) return PinnedBytes();
  {
    absl::MutexLock lock(&mu_);
    if (unsupported_) return PinnedBytes();
    size_t best = idle_.size();
    for (size_t i = 0; i < idle_.size(); ++i) {
      const size_t have = idle_[i].bytes();
      if (have >= bytes && (best == idle_.size() || have < idle_[best].bytes())) {
        best = i;
      }
    }
    if (best < idle_.size()) {
      kernels::HostBuffer buffer = std::move(idle_[best]);
      idle_.erase(idle_.begin() + static_cast<std::ptrdiff_t>(best));
      idle_bytes_ -= buffer.bytes();
      return PinnedBytes(shared_from_this(), std::move(buffer));
    }
  }
  constexpr size_t kMiB = size_t{1} << 20;
  const size_t rounded = (bytes + kMiB - 1) / kMiB * kMiB;
  absl::StatusOr<kernels::HostBuffer> fresh = allocate_(rounded);
  absl::MutexLock lock(&mu_);
  if (!fresh.ok() || fresh->data() == nullptr) {
    if (absl::IsUnimplemented(fresh.status())) unsupported_ = true;
    return PinnedBytes();
  }
  held_bytes_ += fresh->bytes();
  return PinnedBytes(shared_from_this(), *std::move(fresh));
}

void PinnedPool::Give(kernels::HostBuffer buffer) {
  std::vector<kernels::HostBuffer> evicted;  // freed after the lock: freeing may be slow
  {
    absl::MutexLock lock(&mu_);
    // Kept as the most recently used; past the idle bound the least recently used go. A buffer
    // just given back has a size in use now: when the micro-batch size changes (another client,
    // another cut), the old sizes leave the pool rather than every new buffer being freed.
    idle_bytes_ += buffer.bytes();
    idle_.push_back(std::move(buffer));
    size_t oldest = 0;
    while (idle_bytes_ > max_idle_bytes_) {
      idle_bytes_ -= idle_[oldest].bytes();
      held_bytes_ -= idle_[oldest].bytes();
      evicted.push_back(std::move(idle_[oldest]));
      ++oldest;
    }
    idle_.erase(idle_.begin(), idle_.begin() + static_cast<std::ptrdiff_t>(oldest));
  }
}

size_t PinnedPool::idle_bytes() const {
  absl::MutexLock lock(&mu_);
  return idle_bytes_;
}

size_t PinnedPool::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

}  // namespace losshead::server
