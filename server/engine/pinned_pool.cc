#include "server/engine/pinned_pool.h"

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
      if (have >= bytes && have / 2 <= bytes &&
          (best == idle_.size() || have < idle_[best].bytes())) {
        best = i;
      }
    }
    if (best < idle_.size()) {
      kernels::HostBuffer buffer = std::move(idle_[best]);
      idle_[best] = std::move(idle_.back());
      idle_.pop_back();
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
  absl::MutexLock lock(&mu_);
  if (idle_bytes_ + buffer.bytes() > max_idle_bytes_) {
    held_bytes_ -= buffer.bytes();
    return;  // freed here: keeping it would pass the idle bound
  }
  idle_bytes_ += buffer.bytes();
  idle_.push_back(std::move(buffer));
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
