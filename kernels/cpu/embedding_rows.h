// The CPU backend's GatherRows and IndexAddRows (backend.h), split over the pool by rows.
#ifndef LOSSHEAD_KERNELS_CPU_EMBEDDING_ROWS_H_
#define LOSSHEAD_KERNELS_CPU_EMBEDDING_ROWS_H_

#include <cstdint>

#include "kernels/cpu/thread_pool.h"
#include "losshead/kernels/problem.h"

namespace losshead::kernels {

// Arguments valid (embedding_rows.h) and ids in range: copies each id's row.
void CpuGatherRows(DType dtype, const void* weights, int64_t d, const int64_t* ids, int64_t n,
                   void* out, ThreadPool& pool);
// Arguments valid, ids in range and non-decreasing: each run of equal ids is summed in ascending
// order in fp32, then added to its grad row once (the CUDA backend's order, so the same bits).
void CpuIndexAddRows(const float* values, const int64_t* ids, int64_t n, int64_t d, float* grad,
                     ThreadPool& pool);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CPU_EMBEDDING_ROWS_H_
