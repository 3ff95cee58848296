// losshead_kernel_bench's one-call modes: the device memory a fused call needs (--memprobe_n) and
// one call for a profiler (--profile_n).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <memory>
#include <string>

#include "kernels/bench/kernel_bench.h"

namespace losshead::bench {

void MemProbe(const std::string& variant, const Shape& s, const Numerics& num, size_t budget) {
  BENCH_CUDA(cudaFree(nullptr));
  const kernels::CudaBackendOptions opt = ParseVariant(variant);
  std::unique_ptr<Backend> backend = Unwrap(kernels::CreateCudaBackend(0, opt), "backend");
  const BenchTensors t(s, num);
  void *h = t.h, *w = t.w, *dh = t.dh;
  float* dw = t.dw;
  int32_t* y = t.y;
  DeviceBuffer loss = Unwrap(backend->Allocate(4), "alloc");
  DeviceBuffer count = Unwrap(backend->Allocate(8), "alloc");
  BENCH_CUDA(cudaDeviceSynchronize());
  const size_t f0 = FreeBytes();
  std::unique_ptr<kernels::Stream> stream = Unwrap(backend->CreateStream(), "stream");
  const size_t f1 = FreeBytes();
  const Problem p = MakeProblem(s.n, s, num);
  const size_t ws_bytes = Unwrap(backend->WorkspaceBytes(p, budget), "workspace");
  DeviceBuffer ws = Unwrap(backend->Allocate(ws_bytes), "alloc");
  const size_t f2 = FreeBytes();
  Arguments a;
  a.hidden = h;
  a.weight = w;
  a.targets = y;
  a.grad_hidden = dh;
  a.grad_weight = dw;
  a.loss_sum = loss.as<float>();
  a.token_count = count.as<int64_t>();
  a.workspace = ws.data();
  a.workspace_bytes = ws_bytes;
  BENCH_OK(backend->Run(p, a, *stream));
  BENCH_OK(stream->Synchronize());
  const size_t f3 = FreeBytes();
  BENCH_OK(backend->Run(p, a, *stream));
  BENCH_OK(stream->Synchronize());
  const size_t f4 = FreeBytes();
  auto mib = [](size_t a, size_t b) { return (double(a) - double(b)) / (1 << 20); };
  std::printf(
      "memprobe %s%s N=%lld V=%lld D=%lld: stream %.1f MiB, workspace %.1f MiB (%zu B), first "
      "call %.1f MiB, second call %.1f MiB; total extra %.1f MiB\n",
      variant.c_str(), num.Tag().c_str(), (long long)s.n, (long long)s.v, (long long)s.d,
      mib(f0, f1), mib(f1, f2), ws_bytes, mib(f2, f3), mib(f3, f4), mib(f0, f4));
  // A bare handle, step by step, for the record.
  const size_t g0 = FreeBytes();
  cublasHandle_t handle;
  BENCH_CUBLAS(cublasCreate(&handle));
  const size_t g1 = FreeBytes();
  cudaStream_t st;
  BENCH_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  BENCH_CUBLAS(cublasSetStream(handle, st));
  const size_t g2 = FreeBytes();
  BENCH_CUBLAS(cublasSetWorkspace(handle, ws.data(), size_t{4} << 20));
  const size_t g3 = FreeBytes();
  cublasLtHandle_t lt;
  BENCH_CUBLAS(cublasLtCreate(&lt));
  const size_t g4 = FreeBytes();
  std::printf(
      "memprobe bare handle: cublasCreate %.1f MiB, SetStream %.1f MiB, SetWorkspace %.1f "
      "MiB, cublasLtCreate %.1f MiB\n",
      mib(g0, g1), mib(g1, g2), mib(g2, g3), mib(g3, g4));
  cublasLtDestroy(lt);
  cublasDestroy(handle);
}

void ProfileOne(const std::string& variant, const Shape& s, const Numerics& num, size_t budget) {
  std::unique_ptr<Backend> backend =
      Unwrap(kernels::CreateCudaBackend(0, ParseVariant(variant)), "backend");
  const BenchTensors t(s, num);
  void *h = t.h, *w = t.w, *dh = t.dh;
  float* dw = t.dw;
  int32_t* y = t.y;
  BENCH_CUDA(cudaDeviceSynchronize());
  std::unique_ptr<kernels::Stream> stream = Unwrap(backend->CreateStream(), "stream");
  const FusedCall call = MakeFusedCall(*backend, s.n, s, num, budget, h, w, y, dh, dw);
  BENCH_OK(backend->Run(call.problem, call.args, *stream));
  BENCH_OK(stream->Synchronize());
  BENCH_CUDA(cudaProfilerStart());
  BENCH_OK(backend->Run(call.problem, call.args, *stream));
  BENCH_OK(stream->Synchronize());
  BENCH_CUDA(cudaProfilerStop());
  std::printf("profiled one call: variant %s%s N=%lld V=%lld D=%lld workspace %zu B\n",
              variant.c_str(), num.Tag().c_str(), (long long)s.n, (long long)s.v, (long long)s.d,
              call.workspace_bytes);
}

}  // namespace losshead::bench
