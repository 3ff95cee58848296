#include "prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14 (uapi/asm-generic/mman-common.h)
#endif

namespace losshead::client {

void Prefault::Start(void* data, size_t bytes) {
  Wait();
  if (data == nullptr || bytes < kMinBytes) return;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(page - 1);
  if (end <= begin) return;
  thread_ = std::thread([begin, end] {
    // Best effort: on failure (an old kernel, a range not writable as a whole) the copies fault
    // the pages in themselves.
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
  });
}

void Prefault::Wait() {
  if (thread_.joinable()) thread_.join();
}

}  // namespace losshead::client
