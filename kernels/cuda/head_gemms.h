// The three GEMM shapes of a token chunk, shared by Run and a vocabulary shard's calls (whose
// `width` is the shard's rows instead of V). Column-major views, as cuBLAS sees the row-major
// buffers: W (width x D) is W_cm (D x width), H_c (tokens x D) is H_cm (D x tokens), and the
// logits / G chunk (tokens x width, row stride ld) is G_cm (width x tokens, ld).
#ifndef LOSSHEAD_KERNELS_CUDA_HEAD_GEMMS_H_
#define LOSSHEAD_KERNELS_CUDA_HEAD_GEMMS_H_

#include <cstdint>

#include "kernels/cuda/lt_gemm.h"

namespace losshead::kernels::cuda {

// logits^T (width x tokens, ld ldl) = W^T_cm (width x D) . H_cm (D x tokens). Host scalars: with
// a device beta cublasLt cannot know it is 0 and reads the whole output back in its epilogue.
inline GemmShape LogitsGemm(int64_t width, int64_t tokens, int64_t d, cudaDataType_t in,
                            cudaDataType_t logits, int64_t ldl) {
  GemmShape g;
  g.trans_a = CUBLAS_OP_T;
  g.m = static_cast<int>(width);
  g.n = static_cast<int>(tokens);
  g.k = static_cast<int>(d);
  g.type_a = g.type_b = in;
  g.type_c = logits;
  g.lda = g.ldb = static_cast<int>(d);
  g.ldc = static_cast<int>(ldl);
  return g;
}

// dH_cm (D x tokens) = alpha . W_cm (D x width) . G_cm (width x tokens, ld ldg); alpha on the
// device (the mean's 1 / token count is known only there).
inline GemmShape GradHiddenGemm(int64_t width, int64_t tokens, int64_t d, cudaDataType_t in,
                                cudaDataType_t out, int64_t ldg) {
  GemmShape g;
  g.m = static_cast<int>(d);
  g.n = static_cast<int>(tokens);
  g.k = static_cast<int>(width);
  g.type_a = g.type_b = in;
  g.type_c = out;
  g.lda = g.ldc = static_cast<int>(d);
  g.ldb = static_cast<int>(ldg);
  g.device_scalars = true;
  return g;
}

// dW_cm (D x width) += alpha . H_cm (D x tokens) . G_cm^T (tokens x width), into the fp32
// accumulator (beta = 1); alpha on the device.
inline GemmShape GradWeightGemm(int64_t width, int64_t tokens, int64_t d, cudaDataType_t in,
                                int64_t ldg) {
  GemmShape g;
  g.trans_b = CUBLAS_OP_T;
  g.m = static_cast<int>(d);
  g.n = static_cast<int>(width);
  g.k = static_cast<int>(tokens);
  g.type_a = g.type_b = in;
  g.type_c = CUDA_R_32F;
  g.lda = g.ldc = static_cast<int>(d);
  g.ldb = static_cast<int>(ldg);
  g.device_scalars = true;
  return g;
}

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_HEAD_GEMMS_H_
