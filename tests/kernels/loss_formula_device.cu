#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/common/loss_math.h"
#include "kernels/cuda/reduce.cuh"
#include "tests/kernels/loss_formula_device.h"

namespace losshead::kernels::testing {
namespace {

// The cases flattened: case i's logits are x[begin[i], begin[i + 1]).
struct Flat {
  std::vector<float> x;
  std::vector<int> begin{0};
  std::vector<int> target;
  std::vector<loss::Options> options;
  std::vector<float> cap;
};

Flat Flatten(const std::vector<FormulaCase>& cases) {
  Flat f;
  for (const FormulaCase& c : cases) {
    f.x.insert(f.x.end(), c.x.begin(), c.x.end());
    f.begin.push_back(static_cast<int>(f.x.size()));
    f.target.push_back(c.target);
    f.options.push_back(c.options);
    f.cap.push_back(c.options.softcap);
  }
  return f;
}

__global__ void FormulaKernel(int cases, const float* x, const int* begin, const int* target,
                              const loss::Options* options, FormulaResult<float>* fp32,
                              FormulaResult<double>* fp64, float* grad_fp32, double* grad_fp64) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= cases) return;
  const int b = begin[i], v = begin[i + 1] - begin[i];
  fp32[i] = EvaluateFormula<float>(x + b, v, target[i], options[i], grad_fp32 + b);
  fp64[i] = EvaluateFormula<double>(x + b, v, target[i], options[i], grad_fp64 + b);
}

constexpr int kThreads = 256;
constexpr int kVec = 4;

__global__ void __launch_bounds__(kThreads)
    RowStatsKernel(const float* x, const int* begin, const int* target, const float* cap_of,
                   DeviceRowStats* out) {
  __shared__ cuda::SoftmaxState<true> slots[kThreads / cuda::kWarpSize];
  const int i = blockIdx.x;
  const int tid = threadIdx.x;
  const float* row = x + begin[i];
  const int v = begin[i + 1] - begin[i];
  const loss::Softcap cap = loss::Softcap::Of(cap_of[i]);
  cuda::SoftmaxState<true> st = cuda::SoftmaxState<true>::Empty();
  // Thread tid takes vector tid (elements [kVec tid, kVec tid + kVec)) where the row has it, then
  // every kThreads-th element of the rest one by one: both of the row kernels' update paths.
  const int vectors = v / kVec;
  if (tid < vectors) {
    cuda::PushVector<kVec>(st, [&](int k) {
      const int j = tid * kVec + k;
      const float z = cap(row[j]);
      if (j == target[i]) st.zt = z;
      return z;
    });
  }
  for (int j = vectors * kVec + tid; j < v; j += kThreads) {
    const float z = cap(row[j]);
    if (j == target[i]) st.zt = z;
    cuda::Push(st, z);
  }
  cuda::ReduceToWarpSlots<kThreads>(st, cuda::CombineOp{}, slots);
  if (tid == 0) {
    const cuda::SoftmaxState<true> total =
        cuda::FoldWarpSlots<kThreads>(slots, cuda::CombineOp{}, slots[0], 1);
    out[i] = DeviceRowStats{total.m, total.s, total.sz, total.zt};
  }
}

// Device memory for a vector, freed on scope exit.
template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  cudaError_t status = cudaSuccess;
  explicit DeviceArray(size_t count) { status = cudaMalloc(&ptr, (count + 1) * sizeof(T)); }
  DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    if (status == cudaSuccess && !host.empty()) {
      status = cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    }
  }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

std::string Error(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}

template <typename T>
std::string CopyBack(const DeviceArray<T>& d, std::vector<T>* host) {
  const cudaError_t e =
      cudaMemcpy(host->data(), d.ptr, host->size() * sizeof(T), cudaMemcpyDeviceToHost);
  return e == cudaSuccess ? "" : Error("cudaMemcpy", e);
}

}  // namespace

int VisibleCudaDevices() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

std::string EvaluateFormulaOnDevice(const std::vector<FormulaCase>& cases,
                                    std::vector<DeviceFormula>* out) {
  const Flat f = Flatten(cases);
  const int n = static_cast<int>(cases.size());
  DeviceArray<float> x(f.x), grad_fp32(f.x.size());
  DeviceArray<loss::Options> options(f.options);
  DeviceArray<int> begin(f.begin), target(f.target);
  DeviceArray<FormulaResult<float>> fp32(cases.size());
  DeviceArray<FormulaResult<double>> fp64(cases.size());
  DeviceArray<double> grad_fp64(f.x.size());
  for (cudaError_t e : {x.status, options.status, grad_fp32.status, begin.status, target.status,
                        fp32.status, fp64.status, grad_fp64.status}) {
    if (e != cudaSuccess) return Error("setup", e);
  }
  FormulaKernel<<<(n + 127) / 128, 128>>>(n, x.ptr, begin.ptr, target.ptr, options.ptr, fp32.ptr,
                                          fp64.ptr, grad_fp32.ptr, grad_fp64.ptr);
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) return Error("FormulaKernel", e);
  std::vector<FormulaResult<float>> r32(cases.size());
  std::vector<FormulaResult<double>> r64(cases.size());
  std::vector<float> g32(f.x.size());
  std::vector<double> g64(f.x.size());
  for (const std::string& s : {CopyBack(fp32, &r32), CopyBack(fp64, &r64),
                               CopyBack(grad_fp32, &g32), CopyBack(grad_fp64, &g64)}) {
    if (!s.empty()) return s;
  }
  out->assign(cases.size(), DeviceFormula{});
  for (int i = 0; i < n; ++i) {
    DeviceFormula& d = (*out)[i];
    d.fp32 = r32[i];
    d.fp64 = r64[i];
    d.grad_fp32.assign(g32.begin() + f.begin[i], g32.begin() + f.begin[i + 1]);
    d.grad_fp64.assign(g64.begin() + f.begin[i], g64.begin() + f.begin[i + 1]);
  }
  return "";
}

std::string ReduceRowsOnDevice(const std::vector<FormulaCase>& cases,
                               std::vector<DeviceRowStats>* out) {
  const Flat f = Flatten(cases);
  DeviceArray<float> x(f.x), cap(f.cap);
  DeviceArray<int> begin(f.begin), target(f.target);
  DeviceArray<DeviceRowStats> stats(cases.size());
  for (cudaError_t e : {x.status, cap.status, begin.status, target.status, stats.status}) {
    if (e != cudaSuccess) return Error("setup", e);
  }
  RowStatsKernel<<<static_cast<unsigned>(cases.size()), kThreads>>>(x.ptr, begin.ptr, target.ptr,
                                                                    cap.ptr, stats.ptr);
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) return Error("RowStatsKernel", e);
  out->assign(cases.size(), DeviceRowStats{});
  return CopyBack(stats, out);
}

}  // namespace losshead::kernels::testing
