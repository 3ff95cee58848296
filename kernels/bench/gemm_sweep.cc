// losshead_gemm_sweep: every algorithm cublasLt's heuristic offers for the fused call's three
// GEMMs, timed on the chunk shapes the call runs, so that a tile, stage count or cluster shape
// that beats the heuristic's first choice shows itself. The shapes are head_gemms.h's own
// (LogitsGemm, GradHiddenGemm, GradWeightGemm: bf16 in, fp32 sums, bf16 logits and dH, dW added
// into fp32 with beta = 1, alpha on the device), over random data. Each candidate's result is
// first compared with the heuristic's first choice on the same inputs (relative L2 difference and
// the count of elements whose bits differ), then all are timed in rounds (CUDA events, one
// measurement of each candidate per round, median of --runs rounds). A measurement is
// --calls_per_round calls back to back (their mean): with one, the card rests between calls and
// may clock higher than under the fused call's back-to-back GEMMs at its power limit.
//
//   losshead_gemm_sweep --v=128256 --d=4096 --tokens=4096,8192 --candidates=24 --runs=10
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/bench/bench_util.h"
#include "kernels/bench/random_fill.cuh"
#include "kernels/bench/tensor_diff.cuh"
#include "kernels/cuda/head_gemms.h"
#include "kernels/cuda/lt_gemm.h"

namespace losshead::bench {
namespace {

using kernels::cuda::GemmShape;
using kernels::cuda::LtGemm;

struct SweepArgs {
  int64_t v = 128256, d = 4096;
  std::vector<int64_t> tokens = {4096, 8192};
  int candidates = 24;
  int runs = 10;
  int calls_per_round = 1;
  size_t workspace_bytes = size_t{4} << 20;  // the backend's default cuBLAS slice
};

bool ParseSweepArgs(int argc, char** argv, SweepArgs* args) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help") {
      std::printf(
          "losshead_gemm_sweep [--v=V] [--d=D] [--tokens=T,T] [--candidates=K] [--runs=R] "
          "[--calls_per_round=C] [--workspace_mib=M]\n");
      return false;
    }
    if (a.rfind("--v=", 0) == 0) args->v = std::atoll(a.c_str() + 4);
    if (a.rfind("--d=", 0) == 0) args->d = std::atoll(a.c_str() + 4);
    if (a.rfind("--candidates=", 0) == 0) args->candidates = std::atoi(a.c_str() + 13);
    if (a.rfind("--runs=", 0) == 0) args->runs = std::atoi(a.c_str() + 7);
    if (a.rfind("--calls_per_round=", 0) == 0) {
      args->calls_per_round = std::atoi(a.c_str() + 18);
    }
    if (a.rfind("--workspace_mib=", 0) == 0) {
      args->workspace_bytes = size_t(std::atoll(a.c_str() + 16)) << 20;
    }
    if (a.rfind("--tokens=", 0) == 0) {
      args->tokens.clear();
      for (size_t start = 9; start < a.size();) {
        size_t end = a.find(',', start);
        if (end == std::string::npos) end = a.size();
        args->tokens.push_back(std::atoll(a.substr(start, end - start).c_str()));
        start = end + 1;
      }
    }
  }
  if (args->v < 8 || args->v % 8 != 0 || args->d < 8 || args->candidates < 1 || args->runs < 1 ||
      args->calls_per_round < 1) {
    std::fprintf(stderr,
                 "need V and D multiples of 8, --candidates, --runs and --calls_per_round >= 1\n");
    return false;
  }
  for (int64_t t : args->tokens) {
    if (t < 1) {
      std::fprintf(stderr, "bad --tokens\n");
      return false;
    }
  }
  return true;
}

// One GEMM of the fused call: its shape, operands and output, and how to reset the output
// before a checked run (dW adds into what is there).
struct SweptGemm {
  const char* name;
  GemmShape shape;
  const void *alpha, *a, *b, *beta;
  void* c;
  size_t c_count;
  bool c_fp32;
  const void* c_start;  // copied into c before a checked run; null where beta is 0
};

// Checks every candidate first, then times them in rounds, one measurement of each per round
// (RoundsMedianMs), so that the card's clocks drifting over the run (heat, the power limit) weigh
// on all alike.
void Sweep(const SweptGemm& g, const SweepArgs& args, int64_t tokens, double flop, void* workspace,
           void* reference, cudaStream_t stream) {
  const size_t c_bytes = g.c_count * (g.c_fp32 ? 4 : 2);
  std::vector<std::unique_ptr<LtGemm>> candidates;
  std::vector<TensorDiff> diffs;
  auto run = [&](LtGemm& gemm) {
    return gemm.Run(g.shape, g.alpha, g.a, g.b, g.beta, g.c, workspace, args.workspace_bytes,
                    stream);
  };
  for (int rank = 0; rank < args.candidates; ++rank) {
    std::unique_ptr<LtGemm> gemm;
    BENCH_OK(LtGemm::Create(&gemm));
    gemm->set_heuristic_rank(rank);
    // The output starts as dW's start or as NaN (all bits set), so that an element a candidate
    // leaves unwritten shows in the comparison.
    if (g.c_start != nullptr) {
      BENCH_CUDA(cudaMemcpyAsync(g.c, g.c_start, c_bytes, cudaMemcpyDeviceToDevice, stream));
    } else {
      BENCH_CUDA(cudaMemsetAsync(g.c, 0xff, c_bytes, stream));
    }
    const absl::Status planned = run(*gemm);
    if (absl::IsNotFound(planned)) break;  // the heuristic offers no more
    BENCH_OK(planned);
    TensorDiff diff;
    if (rank == 0) {
      BENCH_CUDA(cudaMemcpyAsync(reference, g.c, c_bytes, cudaMemcpyDeviceToDevice, stream));
    } else {
      BENCH_CUDA(DiffTensors(g.c, reference, g.c_count, g.c_fp32, stream, &diff));
    }
    candidates.push_back(std::move(gemm));
    diffs.push_back(diff);
  }
  const size_t count = candidates.size();
  std::vector<std::function<void()>> calls;
  for (size_t i = 0; i < count; ++i) {
    calls.push_back([&, i] {
      for (int call = 0; call < args.calls_per_round; ++call) BENCH_OK(run(*candidates[i]));
    });
  }
  const std::vector<float> round_ms = RoundsMedianMs(stream, 2, args.runs, calls);
  float first_ms = 0;
  for (size_t i = 0; i < count; ++i) {
    const float ms = round_ms[i] / args.calls_per_round;
    if (i == 0) first_ms = ms;
    const std::string rank = std::to_string(i);
    std::printf("| %-6s | %5lld | %4s | %8.3f | %6.1f | %6.3f | %.1e | %11lld | %s |\n", g.name,
                (long long)tokens, rank.c_str(), ms, flop / ms / 1e9, first_ms / ms,
                diffs[i].relative, (long long)diffs[i].differing,
                candidates[i]->LastAlgorithm().c_str());
  }
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  SweepArgs args;
  if (!ParseSweepArgs(argc, argv, &args)) return 1;
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "device: %s, %d SMs; V = %lld, D = %lld; cuBLAS workspace %zu MiB; median of %d rounds of "
      "%d call(s) each\n",
      prop.name, prop.multiProcessorCount, (long long)args.v, (long long)args.d,
      args.workspace_bytes >> 20, args.runs, args.calls_per_round);
  std::printf(
      "| GEMM   | tokens | rank | ms | TFLOP/s | first/this | rel. diff to first | bits differ | "
      "cublasLt configuration |\n");
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t v = args.v, d = args.d;
  int64_t max_tokens = 0;
  for (int64_t t : args.tokens) max_tokens = std::max(max_tokens, t);
  const int64_t ldl = v;  // a multiple of 16 when V is (LogitsStride)
  __nv_bfloat16 *h, *w, *grad, *dh, *logits;
  float *dw, *dw_start, *scalars;
  void *workspace, *reference;
  BENCH_CUDA(cudaMalloc(&h, max_tokens * d * 2));
  BENCH_CUDA(cudaMalloc(&w, v * d * 2));
  BENCH_CUDA(cudaMalloc(&grad, max_tokens * ldl * 2));
  BENCH_CUDA(cudaMalloc(&logits, max_tokens * ldl * 2));
  BENCH_CUDA(cudaMalloc(&dh, max_tokens * d * 2));
  BENCH_CUDA(cudaMalloc(&dw, v * d * 4));
  BENCH_CUDA(cudaMalloc(&dw_start, v * d * 4));
  BENCH_CUDA(cudaMalloc(&reference, std::max(v * d * 4, max_tokens * ldl * 2)));
  BENCH_CUDA(cudaMalloc(&scalars, 3 * sizeof(float)));
  BENCH_CUDA(cudaMalloc(&workspace, std::max<size_t>(args.workspace_bytes, 256)));
  // As kernel_bench's tensors: h ~ U(-1, 1), w ~ U(-a, a) with a = 4 / sqrt(D), a softmax
  // gradient of a few 1e-5 per element, dW small and non-zero.
  BENCH_CUDA(FillUniformBf16(h, max_tokens * d, 1.0f, 1, stream));
  BENCH_CUDA(FillUniformBf16(w, v * d, 4.0f / std::sqrt(float(d)), 2, stream));
  BENCH_CUDA(FillUniformBf16(grad, max_tokens * ldl, 1e-4f, 5, stream));
  BENCH_CUDA(FillUniformF32(dw_start, v * d, 1e-3f, 3, stream));
  for (int64_t tokens : args.tokens) {
    const float host_scalars[3] = {1.0f / float(tokens), 0.0f, 1.0f};  // alpha, zero, one
    BENCH_CUDA(cudaMemcpyAsync(scalars, host_scalars, sizeof(host_scalars), cudaMemcpyHostToDevice,
                               stream));
    static constexpr float kOne = 1.0f, kZero = 0.0f;
    const double flop = 2.0 * double(tokens) * double(v) * double(d);
    const cudaDataType_t bf16 = CUDA_R_16BF;
    const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
    const SweptGemm gemms[] = {
        {"logits", kernels::cuda::LogitsGemm(v, tokens, d, bf16, compute, bf16, ldl), &kOne, w, h,
         &kZero, logits, size_t(tokens * ldl), false, nullptr},
        {"dH", kernels::cuda::GradHiddenGemm(v, tokens, d, bf16, compute, bf16, ldl), scalars, w,
         grad, scalars + 1, dh, size_t(tokens * d), false, nullptr},
        {"dW", kernels::cuda::GradWeightGemm(v, tokens, d, bf16, compute, ldl), scalars, h, grad,
         scalars + 2, dw, size_t(v * d), true, dw_start},
    };
    for (const SweptGemm& g : gemms) Sweep(g, args, tokens, flop, workspace, reference, stream);
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  for (void* p : {(void*)h, (void*)w, (void*)grad, (void*)logits, (void*)dh, (void*)dw,
                  (void*)dw_start, reference, (void*)scalars, workspace}) {
    cudaFree(p);
  }
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace
}  // namespace losshead::bench

int main(int argc, char** argv) { return losshead::bench::Main(argc, argv); }
