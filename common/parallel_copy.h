// Large host-to-host copies on several threads. One thread's memcpy of a 64 MiB dH reaches about
// 9 GB/s on the GPU hosts measured (7.8 ms, an H200 host of 16 cores), four threads about 32 GB/s
// (2.1 ms): the copies of hidden states and dH between page-locked staging, results and shared
// memory are on every micro-batch's path, once or twice at each end.
//
// Invariants:
// - The result is memcpy's: `bytes` bytes of `src` land in `dst` (which must not overlap it)
//   before ParallelCopy returns, on every thread's view.
// - Copies below kParallelCopyMinBytes, and any copy when the helpers are all busy, run on the
//   caller's thread alone: the caller takes pieces itself, and waits only for pieces a helper has
//   already begun, so a copy never waits for a helper to become free.
// - The helpers (kParallelCopyHelpers threads, started at the first large copy and kept for the
//   process's life) are shared by every caller. Thread-safe.
#ifndef LOSSHEAD_COMMON_PARALLEL_COPY_H_
#define LOSSHEAD_COMMON_PARALLEL_COPY_H_

#include <cstddef>

namespace losshead {

// Below this a copy stays on the calling thread: handing pieces over costs more than it saves.
inline constexpr size_t kParallelCopyMinBytes = size_t{8} << 20;
// The pieces the threads take one at a time.
inline constexpr size_t kParallelCopyPieceBytes = size_t{2} << 20;
// Threads besides the caller's: four threads in all already reach the memory's copy rate.
inline constexpr int kParallelCopyHelpers = 3;

void ParallelCopy(void* dst, const void* src, size_t bytes);

}  // namespace losshead

#endif  // LOSSHEAD_COMMON_PARALLEL_COPY_H_
