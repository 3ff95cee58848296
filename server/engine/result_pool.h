// Recycled host buffers for micro-batch results (dH). A fresh multi-megabyte allocation is mapped
// by the kernel page by page on first touch: for 64 MiB of dH the page faults and the zeroing cost
// several times the copy that fills it. A buffer given back is handed out again as it is, its old
// bytes in place, for the caller to overwrite entirely. Thread-safe.
#ifndef LOSSHEAD_SERVER_ENGINE_RESULT_POOL_H_
#define LOSSHEAD_SERVER_ENGINE_RESULT_POOL_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace losshead::server {

class ResultPool {
 public:
  // Keeps at most `max_idle_bytes` of capacity idle; buffers below `min_bytes` are not kept
  // (the allocator's own free lists serve those without page faults).
  explicit ResultPool(size_t max_idle_bytes, size_t min_bytes = size_t{1} << 20)
      : max_idle_bytes_(max_idle_bytes), min_bytes_(min_bytes) {}

  // A string of exactly `bytes` bytes. Recycled ones hold stale bytes: the caller overwrites all.
  std::string Take(size_t bytes);
  // Keeps `buffer` for a later Take while the idle capacity stays within the limit.
  void Give(std::string buffer);

  size_t idle_bytes() const;

 private:
  const size_t max_idle_bytes_;
  const size_t min_bytes_;
  mutable absl::Mutex mu_;
  std::vector<std::string> idle_ ABSL_GUARDED_BY(mu_);
  size_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_RESULT_POOL_H_
