// losshead_kernel_bench's speed of light: the fused call's three GEMMs in plain cuBLAS.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kernels/bench/kernel_bench.h"

namespace losshead::bench {

Sol SpeedOfLight(const Shape& s, const Numerics& num, const void* h, const void* w, void* dh,
                 float* dw, cudaStream_t stream, int runs) {
  cublasHandle_t handle;
  BENCH_CUBLAS(cublasCreate(&handle));
  BENCH_CUBLAS(cublasSetStream(handle, stream));
  void* g = nullptr;
  BENCH_CUDA(cudaMalloc(&g, s.n * s.v * num.bytes()));
  const float one = 1.0f, zero = 0.0f, scale = 1.0f / s.n;
  const int n = s.n, v = s.v, d = s.d;
  const cudaDataType_t type = num.cuda_type();
  const cublasComputeType_t compute = num.compute();
  Sol sol;
  sol.logits_ms = MedianMs(stream, 3, runs, [&] {
    BENCH_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, v, n, d, &one, w, type, d, h, type,
                              d, &zero, g, type, v, compute, CUBLAS_GEMM_DEFAULT));
  });
  // g now holds real logits: random-looking data for the gradient GEMMs, never zeros.
  sol.dh_ms = MedianMs(stream, 3, runs, [&] {
    BENCH_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, d, n, v, &scale, w, type, d, g,
                              type, v, &zero, dh, type, d, compute, CUBLAS_GEMM_DEFAULT));
  });
  sol.dw_ms = MedianMs(stream, 3, runs, [&] {
    BENCH_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, d, v, n, &scale, h, type, d, g,
                              type, v, &one, dw, CUDA_R_32F, d, compute, CUBLAS_GEMM_DEFAULT));
  });
  BENCH_CUDA(cudaStreamSynchronize(stream));
  BENCH_CUDA(cudaFree(g));
  cublasDestroy(handle);
  return sol;
}

}  // namespace losshead::bench
