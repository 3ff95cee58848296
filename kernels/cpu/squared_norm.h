// The CPU squared L2 norm: fp64 partial sums over fixed chunks, added in chunk order.
#ifndef LOSSHEAD_KERNELS_CPU_SQUARED_NORM_H_
#define LOSSHEAD_KERNELS_CPU_SQUARED_NORM_H_

#include <cstdint>

#include "kernels/cpu/thread_pool.h"

namespace losshead::kernels {

// Sum of data[i]^2 over [0, count). The chunks and the order within and across them depend on
// `count` only, so the result has the same bits for every thread count.
double CpuSquaredNorm(const float* data, int64_t count, ThreadPool& pool);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CPU_SQUARED_NORM_H_
