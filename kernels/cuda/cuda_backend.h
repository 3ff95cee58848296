// The CUDA backend: W, dW and the workspace in device memory, cuBLAS GEMMs per token chunk.
#ifndef LOSSHEAD_KERNELS_CUDA_CUDA_BACKEND_H_
#define LOSSHEAD_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"

namespace losshead::kernels {

// Number of visible CUDA devices; 0 when there is no driver or device.
int CudaDeviceCount();

// UNAVAILABLE when `device` does not exist.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device);

// Tuning knobs of the CUDA backend; the defaults are the measured best (see BENCHMARKS.md).
struct CudaBackendOptions {
  // bf16 problems only: store each chunk's logits in bf16 instead of fp32. Halves the workspace
  // per token (twice the chunk rows in the same budget, half the dW read-modify-writes) and the
  // row kernel's traffic, at the price of rounding the logits to bf16 before the softmax.
  bool bf16_logits = true;
  // Threads per row of the softmax/gradient kernel: 512 or 1024 (1024 keeps fewer rows live, so
  // the gradient pass re-reads its row from L2 more often).
  int row_threads = 512;
  // Part of the workspace handed to the cublasLt GEMMs. The large GEMMs here need no split-K:
  // 4 MiB is enough for them and lets a 4096-row chunk of bf16 logits at V = 128256 fit in 1 GiB.
  size_t cublas_workspace_bytes = size_t{4} << 20;
  // Device memory that a stream holds outside the workspace (its second stream and events; the
  // cublasLt handle allocates none). WorkspaceBytes keeps it out of the budget, so that the
  // workspace plus the stream stay within what the caller asked for.
  size_t handle_reserve_bytes = size_t{4} << 20;
  // Split N into equal chunks (multiples of 128 rows) instead of full chunks and a remainder:
  // no small, inefficient tail chunk.
  bool balance_chunks = true;
  // At most this many rows of the row kernel per SM at once (0: no cap), so that the rows in
  // flight fit in L2 and the gradient pass re-reads them from there.
  int row_blocks_per_sm = 0;
  // Split each chunk in two halves of tokens and run a half's row kernel on a second stream while
  // the GEMMs of the other half run.
  bool overlap = false;
  // Which of cuBLASLt's candidates the logits, dH and dW GEMMs take (0: the heuristic's first;
  // losshead_gemm_sweep ranks them). A later one only where it computes the first's bits
  // (LtGemm::set_role_ranks), so results do not change; speed may.
  int gemm_ranks[3] = {0, 0, 0};
  // bf16 problems with bf16 logits on a compute capability 9.0 device: the logits GEMM of our own
  // (logits_gemm_sm90.cuh, on wgmma and bulk tensor copies) instead of cuBLASLt's. It also leaves
  // each row's log-sum-exp per 256 columns, so that the row kernel reads the logits once instead
  // of twice where the loss takes them as they are (no soft-cap, label smoothing or terms; with
  // distribution outputs their kernels still read the row for their own statistics). Costs a
  // float of workspace per 256 columns per token row (2 KB at V = 128256, 0.8 % of its bf16
  // logits). Elsewhere, and where H or W is not 16-byte aligned, cuBLASLt's GEMM runs as before.
  // Off: on an H200 the fused call took as long with it (V = 128256) or longer (the Gemma-2 shape,
  // whose chunk the statistics push below 2048 rows), BENCHMARKS.md "Our GEMM in the fused call".
  bool sm90_logits_gemm = false;
};

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device,
                                                           const CudaBackendOptions& options);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_CUDA_CUDA_BACKEND_H_
