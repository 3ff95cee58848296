// How far the CUDA backend's results may be from the CPU backend's, as relative norms: fp32 GEMMs
// on both sides differ only in summation order; bf16 / fp16 round the logit gradient to the input
// dtype before the GEMMs and dH once at the end; bf16 logits also round each logit before the
// softmax. An fp32 problem at a faster precision (problem.h) rounds its GEMMs' inputs, on the
// GPU only: to TF32's 10 mantissa bits (high, about fp16's bound) or bf16's 7 (medium, about the
// bf16-logits bound).
#ifndef LOSSHEAD_TESTS_CUDA_TOLERANCE_H_
#define LOSSHEAD_TESTS_CUDA_TOLERANCE_H_

#include "losshead/kernels/problem.h"

namespace losshead::kernels {

struct Tolerance {
  double loss, dh, dw;
};

// `bf16_logits`: the problem's logits are stored in bf16 (CudaBackendOptions::bf16_logits on a
// bf16 problem).
inline Tolerance ToleranceFor(DType dtype, bool bf16_logits,
                              MatmulPrecision precision = MatmulPrecision::kHighest) {
  switch (dtype) {
    case DType::kFP32:
      switch (precision) {
        case MatmulPrecision::kHigh:
          return {1e-3, 8e-3, 8e-3};
        case MatmulPrecision::kMedium:
          return {8e-3, 5e-2, 5e-2};
        case MatmulPrecision::kHighest:
          break;
      }
      return {1e-5, 1e-4, 1e-4};
    case DType::kFP16:
      return {1e-4, 4e-3, 4e-3};
    case DType::kBF16:
      // bf16 logits round each logit by up to 2^-9 of its size before the softmax.
      return bf16_logits ? Tolerance{4e-3, 3e-2, 3e-2} : Tolerance{1e-4, 1.2e-2, 1.2e-2};
  }
  return {0, 0, 0};
}

}  // namespace losshead::kernels

#endif  // LOSSHEAD_TESTS_CUDA_TOLERANCE_H_
