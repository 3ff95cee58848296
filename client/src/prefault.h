// Maps a fresh destination's pages in ahead of the copies that fill it. A pull or download into
// memory never touched before (a new tensor) otherwise takes one page fault, and the kernel's
// zeroing of a page, per 4 KiB on the thread that copies the received bytes: for a 2 GiB dW that
// halved the pull's rate (BENCHMARKS.md). The kernel populates the range on a thread of its own
// (madvise MADV_POPULATE_WRITE), ahead of the copies and beside them; pages already present cost
// a walk of their page tables.
#ifndef LOSSHEAD_CLIENT_SRC_PREFAULT_H_
#define LOSSHEAD_CLIENT_SRC_PREFAULT_H_

#include <cstddef>
#include <thread>

namespace losshead::client {

class Prefault {
 public:
  // Ranges smaller than this are left alone: their faults cost less than a thread.
  static constexpr size_t kMinBytes = size_t{64} << 20;

  Prefault() = default;
  Prefault(const Prefault&) = delete;
  Prefault& operator=(const Prefault&) = delete;
  ~Prefault() { Wait(); }

  // Starts populating the whole pages of [data, data + bytes) for writing when the range is at
  // least kMinBytes. A kernel without MADV_POPULATE_WRITE (before Linux 5.14) leaves the faults
  // to the copies, as before.
  void Start(void* data, size_t bytes);
  // Returns once the population has ended (at once if none was started).
  void Wait();

 private:
  std::thread thread_;
};

}  // namespace losshead::client

#endif  // LOSSHEAD_CLIENT_SRC_PREFAULT_H_
