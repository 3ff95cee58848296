// How far one device tensor is from another, on the device (a 2 GiB fp32 dW need not cross to
// the host to be compared).
#ifndef LOSSHEAD_KERNELS_BENCH_TENSOR_DIFF_CUH_
#define LOSSHEAD_KERNELS_BENCH_TENSOR_DIFF_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace losshead::bench {

struct TensorDiff {
  double relative = 0;    // ||a - b|| / ||b|| (L2, in float64); NaN where either holds a NaN
  int64_t differing = 0;  // elements whose bits differ
};

// a and b: `count` elements of bf16 (`fp32` false) or fp32. Synchronises `stream`.
cudaError_t DiffTensors(const void* a, const void* b, int64_t count, bool fp32, cudaStream_t stream,
                        TensorDiff* out);

}  // namespace losshead::bench

#endif  // LOSSHEAD_KERNELS_BENCH_TENSOR_DIFF_CUH_
