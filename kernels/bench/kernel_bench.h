// The pieces of losshead_kernel_bench (kernel_bench.cc), one job per file: the shapes, numerics,
// tensors and fused call every part uses (kernel_bench_setup.cc), the command line
// (kernel_bench_args.cc), the float64 check of a fused call (kernel_bench_check.cc), the
// speed-of-light GEMMs (kernel_bench_sol.cc) and the one-call memory probe and profile
// (kernel_bench_probes.cc).
#ifndef LOSSHEAD_KERNELS_BENCH_KERNEL_BENCH_H_
#define LOSSHEAD_KERNELS_BENCH_KERNEL_BENCH_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/bench/bench_util.h"
#include "kernels/bench/random_fill.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/head_gemms.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"

#define BENCH_CUBLAS(expr)                                               \
  do {                                                                   \
    cublasStatus_t e_ = (expr);                                          \
    if (e_ != CUBLAS_STATUS_SUCCESS) {                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
                   cublasGetStatusString(e_));                           \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

namespace losshead::bench {

using kernels::Arguments;
using kernels::Backend;
using kernels::DeviceBuffer;
using kernels::DType;
using kernels::MatmulPrecision;
using kernels::Problem;

struct Shape {
  int64_t n, v, d;
};

// The element type of H, W and dH and what the GEMMs may round them to (--dtype, --precision).
struct Numerics {
  DType dtype = DType::kBF16;
  MatmulPrecision precision = MatmulPrecision::kHighest;

  size_t bytes() const { return kernels::DTypeSize(dtype); }
  cudaDataType_t cuda_type() const { return dtype == DType::kFP32 ? CUDA_R_32F : CUDA_R_16BF; }
  // The backend's own choice: the speed of light must run the GEMMs on the units the fused call
  // may use, or it measures something else.
  cublasComputeType_t compute() const {
    Problem p;
    p.dtype = dtype;
    p.precision = precision;
    return kernels::cuda::GemmCompute(p);
  }
  // "bf16" alone for the default, so that the header line reads as it always has.
  std::string Label() const {
    if (dtype == DType::kBF16) return "bf16";
    return std::string(kernels::DTypeName(dtype)) + ", matmul precision " +
           std::string(kernels::MatmulPrecisionName(precision));
  }
  // Appended to the one-line reports of --memprobe_n and --profile_n: nothing for the default.
  std::string Tag() const { return dtype == DType::kBF16 ? "" : " [" + Label() + "]"; }
};

Problem MakeProblem(int64_t n, const Shape& s, const Numerics& num);

// data[i] uniform in [-scale, scale), the same draw in either dtype (bf16 rounds it).
cudaError_t FillUniform(const Numerics& num, void* data, int64_t count, float scale, uint64_t seed);

// Free device memory now (cudaMemGetInfo).
size_t FreeBytes();

// A shape's device tensors, filled with random data (never zeros): |logit| of a few units, as in
// a trained head: h ~ U(-1, 1), w ~ U(-a, a) with a = 4/sqrt(D); dW starts small and non-zero.
struct BenchTensors {
  BenchTensors(const Shape& s, const Numerics& num) {
    BENCH_CUDA(cudaMalloc(&h, s.n * s.d * num.bytes()));
    BENCH_CUDA(cudaMalloc(&w, s.v * s.d * num.bytes()));
    BENCH_CUDA(cudaMalloc(&dh, s.n * s.d * num.bytes()));
    BENCH_CUDA(cudaMalloc(&dw, s.v * s.d * 4));
    BENCH_CUDA(cudaMalloc(&y, s.n * 4));
    BENCH_CUDA(FillUniform(num, h, s.n * s.d, 1.0f, 1));
    BENCH_CUDA(FillUniform(num, w, s.v * s.d, 4.0f / std::sqrt(float(s.d)), 2));
    BENCH_CUDA(bench::FillUniformF32(dw, s.v * s.d, 1e-3f, 3, nullptr));
    BENCH_CUDA(bench::FillTargets(y, s.n, s.v, 4, nullptr));
  }
  ~BenchTensors() {
    for (void* ptr : {h, w, dh, (void*)dw, (void*)y}) cudaFree(ptr);
  }
  BenchTensors(const BenchTensors&) = delete;
  BenchTensors& operator=(const BenchTensors&) = delete;

  void *h = nullptr, *w = nullptr, *dh = nullptr;  // Numerics::dtype
  float* dw = nullptr;
  int32_t* y = nullptr;
};

// One fused call over caller-owned device tensors (H, W and dH of the numerics' dtype, fp32 dW,
// int32 targets), default options: the problem, its workspace and scalar outputs, and the
// arguments.
struct FusedCall {
  Problem problem;
  size_t workspace_bytes = 0;
  DeviceBuffer workspace, loss, count;
  Arguments args;
};

FusedCall MakeFusedCall(Backend& backend, int64_t n, const Shape& s, const Numerics& num,
                        size_t budget, const void* hidden, const void* weight,
                        const int32_t* targets, void* grad_hidden, float* grad_weight);

// A variant is '+'-joined tokens over the backend's defaults: fp32logits, t1024, bal/nobal,
// ws<MiB> (cuBLAS workspace), res<MiB> (handle reserve), bps<k> (row blocks per SM), ovl,
// rl<k> / rh<k> / rw<k> (the logits / dH / dW GEMM's cuBLASLt candidate, CudaBackendOptions).
// "default" alone is the backend's defaults.
kernels::CudaBackendOptions ParseVariant(const std::string& variant);

// The distribution outputs (problem.h) a timed call asks for beside the plain one (--outputs):
// '+'- or ','-joined logprob, entropy, argmax, correct (correct_count) and topk:K (ids and
// log-probs, K in [1, kMaxTopK]).
struct BenchOutputs {
  bool logprob = false, entropy = false, argmax = false, correct_count = false;
  int32_t top_k = 0;
  std::string label;  // as given

  bool any() const { return logprob || entropy || argmax || correct_count || top_k > 0; }
};

// Parses --outputs' value; false (after printing why) for an unknown name or a bad K.
bool ParseOutputs(const std::string& value, BenchOutputs* outputs);

// The command line: --name=value flags (ParseArgs lists them; unknown ones are ignored).
struct BenchArgs {
  int runs = 20;
  size_t budget = size_t{1} << 30;
  std::string variants = "default,fp32logits";
  std::vector<Shape> shapes;
  Numerics numerics;
  int64_t profile_n = 0, memprobe_n = 0;
  BenchOutputs outputs;  // none: only the plain call is timed
};

// Parses argv into *args; false (after printing why) for a bad --shapes, --dtype, --precision or
// --outputs, and after printing the flags for --help.
bool ParseArgs(int argc, char** argv, BenchArgs* args);

struct CheckResult {
  double loss_err, dh_err, dw_err;
};

// float64 reference for the first `m` tokens (mean reduction, default options) against a fused
// call on those tokens alone. dW is compared on the target rows plus a spread of other rows. The
// reference takes H and W as stored, unrounded: for an fp32 problem at high or medium precision
// the check measures the GEMMs' rounding too.
CheckResult Check(Backend& backend, kernels::Stream& stream, const Shape& s,
                  const Numerics& numerics, const void* hidden, const void* weight,
                  const int32_t* targets, int64_t m);

struct Sol {
  float logits_ms, dh_ms, dw_ms;
  float total() const { return logits_ms + dh_ms + dw_ms; }
};

// The same three GEMMs in plain cuBLAS over all N tokens, logits materialised in the problem's
// dtype (bf16 or fp32), with the compute type of the fused call's GEMMs.
Sol SpeedOfLight(const Shape& s, const Numerics& num, const void* h, const void* w, void* dh,
                 float* dw, cudaStream_t stream, int runs);

// Device memory that one fused call needs in a fresh process, step by step (cudaMemGetInfo):
// the stream (cuBLAS handle), the workspace, and the first and second calls (lazily loaded
// kernels, anything cuBLAS allocates on first use). Then the same for a bare cuBLAS handle.
void MemProbe(const std::string& variant, const Shape& s, const Numerics& num, size_t budget);

// One fused call between cudaProfilerStart/Stop after a warm-up call, for a per-kernel profile
// (ncu --profile-from-start off).
void ProfileOne(const std::string& variant, const Shape& s, const Numerics& num, size_t budget);

}  // namespace losshead::bench

#endif  // LOSSHEAD_KERNELS_BENCH_KERNEL_BENCH_H_
