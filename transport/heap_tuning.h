// Heap settings for a process that moves tensors through gRPC, shared by the server, the command
// line client and the C API.
//
// gRPC receives every message (4 MiB by default) into fresh buffers and frees them once the
// message is consumed; its sends allocate the same way. With glibc's defaults such buffers are
// mmapped and unmapped one by one, or the heap's top is trimmed as soon as they are freed, so
// every message faults its pages in again (and each map and unmap takes the process's
// address-space lock, which stalls the page faults of every other thread). The settings keep the
// memory: allocations below 32 MiB come from the heap (glibc's largest accepted threshold), and
// freed memory stays mapped until 1 GiB of it is free at the heap's top.
//
// Measured (BENCHMARKS.md): a push into the server ran at 0.3 GB/s with the defaults and 1.6 GB/s
// with the settings; a pull of 512 MB into a reused tensor at 0.4 and 2.1-2.4 GB/s.
#ifndef LOSSHEAD_TRANSPORT_HEAP_TUNING_H_
#define LOSSHEAD_TRANSPORT_HEAP_TUNING_H_

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace losshead::transport {

// Applies the settings above; false where the C library is not glibc, refused one of them, or
// the environment says LOSSHEAD_TUNE_MALLOC=0 (a process that tunes its allocator itself).
inline bool KeepTransferBuffersMapped() {
  const char* tune = std::getenv("LOSSHEAD_TUNE_MALLOC");
  if (tune != nullptr && std::strcmp(tune, "0") == 0) return false;
#if defined(__GLIBC__)
  return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
#else
  return false;
#endif
}

}  // namespace losshead::transport

#endif  // LOSSHEAD_TRANSPORT_HEAP_TUNING_H_
