#include "server/engine/result_pool.h"

#include <utility>

namespace losshead::server {

std::string ResultPool::Take(size_t bytes) {
  std::string out;
  if (bytes >= min_bytes_) {
    absl::MutexLock lock(&mu_);
    // The smallest idle buffer that fits, and not one more than twice too large: a small result
    // must not pin a large buffer that a full-size micro-batch will want next.
    size_t best = idle_.size();
    for (size_t i = 0; i < idle_.size(); ++i) {
      const size_t cap = idle_[i].capacity();
      if (cap < bytes || cap / 2 > bytes) continue;
      if (best == idle_.size() || cap < idle_[best].capacity()) best = i;
    }
    if (best < idle_.size()) {
      idle_bytes_ -= idle_[best].capacity();
      out = std::move(idle_[best]);
      idle_[best] = std::move(idle_.back());
      idle_.pop_back();
    }
  }
  // Shrinking keeps the capacity and writes nothing; growing within the capacity fills only the
  // new tail. A miss allocates (zero-filled): the cost the pool exists to avoid next time.
  out.resize(bytes);
  return out;
}

void ResultPool::Give(std::string buffer) {
  const size_t cap = buffer.capacity();
  if (cap < min_bytes_) return;
  absl::MutexLock lock(&mu_);
  if (idle_bytes_ + cap > max_idle_bytes_) return;  // freed on return, after the lock
  idle_bytes_ += cap;
  idle_.push_back(std::move(buffer));
}

size_t ResultPool::idle_bytes() const {
  absl::MutexLock lock(&mu_);
  return idle_bytes_;
}

}  // namespace losshead::server
