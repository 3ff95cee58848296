// Device-resident scalars shared by the kernels and the cuBLAS calls of one Run.
#ifndef LOSSHEAD_KERNELS_CUDA_SCALARS_H_
#define LOSSHEAD_KERNELS_CUDA_SCALARS_H_

namespace losshead::kernels::cuda {

// Lives in the workspace. The GEMMs read alpha/beta from here (cuBLAS device pointer mode) so that
// the mean reduction's 1/token_count, known only on the device, scales the gradient GEMMs without
// a host round trip.
struct RunScalars {
  float one;         // alpha of the logits GEMM, beta of the dW accumulation
  float zero;        // beta of the logits and dH GEMMs
  float grad_alpha;  // grad_scale, divided by the token count for the mean reduction
  float unused;
  double loss_acc;   // running loss sum over chunks (fp64 so that the chunk order adds no error)
};

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_SCALARS_H_
