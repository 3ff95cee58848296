// The device side of the model options and loss terms (problem.h; RowTerms, softmax_grad.cuh),
// shared by the row kernel of one device (softmax_grad.cu) and the shard kernels
// (shard_softmax.cu): z from the scaled and biased logit, a token's inputs, and the gradient of a
// column from the factors its row's thread 0 formed (loss_math.h's TermsLossOf). Included by .cu
// files only.
//
// Invariants: every function here is __forceinline__ and one expression tree per value, so that a
// kernel computes the bits it computed with the expressions written out in it; a row's factors
// are written by one thread to SharedTermFactors() and read by all after a barrier.
#ifndef LOSSHEAD_KERNELS_CUDA_ROW_TERMS_CUH_
#define LOSSHEAD_KERNELS_CUDA_ROW_TERMS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/loss_math.h"
#include "kernels/cuda/softmax_grad.cuh"

namespace losshead::kernels::cuda {

// A row's gradient factors with the terms on, against lse (e_j = exp(z_j - lse)): the loss's
// (GradFactors), the entropy term's, and whether that term is on. The token's weight and the
// logit scale are folded into both.
struct TermFactors {
  loss::GradFactors factors;
  loss::EntropyGrad entropy;
  bool entropy_on;
};

// The block's one TermFactors: a function's static shared variable, so that only the
// instantiations with the terms have it.
__device__ __forceinline__ TermFactors& SharedTermFactors() {
  __shared__ TermFactors slot;
  return slot;
}

// z of the logit x (u = h . w_j) of column j: the scale and the bias before the soft-cap
// (ScaleBiasRow's order). `bias` by column, or null.
__device__ __forceinline__ float TermsZ(const loss::Softcap& cap, float x, float logit_scale,
                                        const float* bias, int64_t j) {
  return cap(loss::ScaledLogit(x, logit_scale, bias != nullptr ? bias[j] : 0.0f));
}

// Row r's inputs to the terms, in T (the per-token arrays by row; 1 and 0 where not given).
template <typename T>
__device__ __forceinline__ loss::BasicTokenInputs<T> TokenInputsAt(const RowTerms& rt, int64_t r) {
  loss::BasicTokenInputs<T> in;
  if (rt.token_weights != nullptr) in.weight = rt.token_weights[r];
  if (rt.terms.policy_gradient) {
    in.old_logprob = rt.old_logprob[r];
    in.advantage = rt.advantages[r];
    if (rt.terms.kl_coef > 0.0f) in.ref_logprob = rt.ref_logprob[r];
  }
  return in;
}

// dloss/dz_j chained through the soft-cap, from z_j and the row's lse: the loss's and the entropy
// term's parts (both against lse: z_j - sum_k p_k z_k = (z_j - lse) + entropy), times the factors'
// folded scale.
__device__ __forceinline__ float TermsLogitGrad(const TermFactors& tf, const loss::Softcap& cap,
                                                float z, float lse, bool is_target) {
  const float shifted = z - lse;
  const float e = loss::Exp(shifted);
  float g = loss::LogitGrad(tf.factors, e, is_target);
  if (tf.entropy_on) g += loss::EntropyLogitGrad(tf.entropy, e, shifted);
  if (cap.cap > 0.0f) g *= loss::SoftcapSlope(z * cap.inv_cap);
  return g;
}

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_ROW_TERMS_CUH_
