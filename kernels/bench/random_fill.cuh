// Device-side random data for the benchmark: counter-based, so filling gigabytes costs no host time.
#ifndef LOSSHEAD_KERNELS_BENCH_RANDOM_FILL_CUH_
#define LOSSHEAD_KERNELS_BENCH_RANDOM_FILL_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace losshead::bench {

// data[i] = uniform in [-scale, scale) from hash(seed, i).
cudaError_t FillUniformBf16(__nv_bfloat16* data, int64_t count, float scale, uint64_t seed,
                            cudaStream_t stream);
cudaError_t FillUniformF32(float* data, int64_t count, float scale, uint64_t seed,
                           cudaStream_t stream);
// data[i] = uniform in [lo, hi) from hash(seed, i).
cudaError_t FillUniformF32Between(float* data, int64_t count, float lo, float hi, uint64_t seed,
                                  cudaStream_t stream);
// targets[i] uniform in [0, v).
cudaError_t FillTargets(int32_t* targets, int64_t count, int64_t v, uint64_t seed,
                        cudaStream_t stream);

}  // namespace losshead::bench

#endif  // LOSSHEAD_KERNELS_BENCH_RANDOM_FILL_CUH_
