// The CUDA backend. Per token chunk of C rows:
//   logits (C x V)  = H_c . W^T                      cuBLAS, fp32 accumulation
//   row kernel      : soft-cap, softmax, lse, loss; overwrites the logits with the unscaled
//                     gradient G in the input dtype (the next GEMMs' operand)
//   dH_c  (C x D)   = alpha . G . W                  cuBLAS, written in the input dtype
//   dW    (V x D)  += alpha . G^T . H_c              cuBLAS, fp32 accumulator, beta = 1
// alpha (grad_scale, / token_count for the mean) is computed on the device by a prologue kernel and
// read by cuBLAS in device pointer mode, so nothing in Run waits for the GPU.
#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/count_targets.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/loss_reduce.cuh"
#include "kernels/cuda/scalars.h"
#include "kernels/cuda/softmax_grad.cuh"

namespace losshead::kernels {
namespace {

using cuda::RunScalars;

constexpr size_t kAlign = 256;
constexpr size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// A CUDA stream with its own cuBLAS handle: Run on different streams never shares a handle, and
// the mutex serialises two threads that enqueue on the same stream (cuBLAS handles are not
// thread-safe, and the per-Run cublasSetWorkspace must stay paired with its GEMMs).
class CudaStream final : public Stream {
 public:
  CudaStream(int device, cudaStream_t stream, cublasHandle_t handle)
      : device_(device), stream_(stream), handle_(handle) {}
  ~CudaStream() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cublasDestroy(handle_);
    cudaStreamDestroy(stream_);
  }

  absl::Status Synchronize() override {
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    LOSSHEAD_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  void* native() const override { return stream_; }

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t handle() const { return handle_; }
  std::mutex& mutex() { return mu_; }

 private:
  const int device_;
  const cudaStream_t stream_;
  const cublasHandle_t handle_;
  std::mutex mu_;
};

template <typename T>
constexpr cudaDataType_t CudaType();
template <>
constexpr cudaDataType_t CudaType<float>() { return CUDA_R_32F; }
template <>
constexpr cudaDataType_t CudaType<__nv_bfloat16>() { return CUDA_R_16BF; }
template <>
constexpr cudaDataType_t CudaType<__half>() { return CUDA_R_16F; }

// Where each part of the workspace lives for a chunk of `chunk` rows.
struct Layout {
  int64_t chunk = 0;
  int64_t ldl = 0;          // logits row stride in elements (V rounded up to 16: aligned vectors)
  size_t logits_elem = 0;   // bytes per logits element
  size_t scalars_off = 0;
  size_t row_loss_off = 0;
  size_t cublas_off = 0;
  size_t cublas_bytes = 0;
  size_t logits_off = 0;
  size_t total = 0;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const CudaBackendOptions& options, std::string description)
      : device_(device), options_(options), description_(std::move(description)) {}

  absl::string_view name() const override { return "cuda"; }
  std::string device_description() const override { return description_; }

  MemoryInfo memory_info() const override {
    MemoryInfo info;
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(device_) == cudaSuccess &&
        cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      info.free_bytes = free_bytes;
      info.total_bytes = total_bytes;
    }
    return info;
  }

  absl::Status CanImplement(const Problem& problem) const override {
    if (absl::Status s = ValidateProblem(problem); !s.ok()) return s;
    // cuBLAS takes int sizes and strides; the narrowed gradient's stride is up to 2 * ldl.
    constexpr int64_t kIntMax = 2147483647;
    if (problem.d > kIntMax) {
      return absl::InvalidArgumentError(absl::StrCat("d must fit in int32, got ", problem.d));
    }
    if (2 * LogitsStride(problem.v) > kIntMax) {
      return absl::InvalidArgumentError(
          absl::StrCat("v too large for the CUDA backend (max ~1e9), got ", problem.v));
    }
    if (problem.n > kIntMax) {
      return absl::InvalidArgumentError(absl::StrCat("n must fit in int32, got ", problem.n));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<size_t> WorkspaceBytes(const Problem& problem,
                                        size_t budget_bytes) const override {
    if (absl::Status s = CanImplement(problem); !s.ok()) return s;
    const Layout layout = MakeLayout(problem, budget_bytes);
    if (layout.chunk < 1) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "workspace budget of ", budget_bytes, " bytes holds no chunk: at least ",
          MakeLayoutForChunk(problem, 1).total, " bytes are needed for v = ", problem.v));
    }
    return layout.total;
  }

  absl::Status Run(const Problem& problem, const Arguments& args, Stream& stream) override {
    if (absl::Status s = CanImplement(problem); !s.ok()) return s;
    auto* cs = dynamic_cast<CudaStream*>(&stream);
    if (cs == nullptr || cs->device() != device_) {
      return absl::InvalidArgumentError("stream was not created by this CUDA backend");
    }
    if (args.hidden == nullptr || args.weight == nullptr || args.targets == nullptr) {
      return absl::InvalidArgumentError("hidden, weight and targets must not be null");
    }
    if (args.loss_sum == nullptr || args.token_count == nullptr) {
      return absl::InvalidArgumentError("loss_sum and token_count must not be null");
    }
    if (args.workspace == nullptr ||
        reinterpret_cast<uintptr_t>(args.workspace) % kAlign != 0) {
      return absl::InvalidArgumentError("workspace must be a 256-byte aligned device pointer");
    }
    const Layout layout = MakeLayout(problem, args.workspace_bytes);
    if (layout.chunk < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "workspace of ", args.workspace_bytes, " bytes is too small: at least ",
          MakeLayoutForChunk(problem, 1).total, " bytes are needed (see WorkspaceBytes)"));
    }

    std::lock_guard<std::mutex> lock(cs->mutex());
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    switch (problem.dtype) {
      case DType::kFP32:
        return RunTyped<float, float>(problem, args, layout, *cs);
      case DType::kFP16:
        return RunTyped<__half, float>(problem, args, layout, *cs);
      case DType::kBF16:
        if (UseBf16Logits(problem)) {
          return RunTyped<__nv_bfloat16, __nv_bfloat16>(problem, args, layout, *cs);
        }
        return RunTyped<__nv_bfloat16, float>(problem, args, layout, *cs);
    }
    return absl::InvalidArgumentError("unknown dtype");
  }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    void* data = nullptr;
    if (bytes > 0) LOSSHEAD_CUDA_CHECK(cudaMalloc(&data, bytes));
    return DeviceBuffer(this, data, bytes);
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    cudaStream_t stream = nullptr;
    LOSSHEAD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cublasHandle_t handle = nullptr;
    const cublasStatus_t st = cublasCreate(&handle);
    if (st != CUBLAS_STATUS_SUCCESS) {
      cudaStreamDestroy(stream);
      LOSSHEAD_CUBLAS_CHECK(st);
    }
    auto result = std::make_unique<CudaStream>(device_, stream, handle);
    LOSSHEAD_CUBLAS_CHECK(cublasSetStream(handle, stream));
    // The gradient GEMMs' alpha/beta live in device memory (RunScalars). No TF32 for fp32 problems, and no split-K
    // reductions in the 16-bit output type.
    LOSSHEAD_CUBLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_DEVICE));
    LOSSHEAD_CUBLAS_CHECK(cublasSetMathMode(
        handle, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                          CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    return std::unique_ptr<Stream>(std::move(result));
  }

  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes,
                            Stream& stream) override {
    return Copy(dst, host_src, bytes, stream);
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes,
                          Stream& stream) override {
    return Copy(host_dst, src, bytes, stream);
  }
  absl::Status Memset(void* dst, int value, size_t bytes, Stream& stream) override {
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    LOSSHEAD_CUDA_CHECK(
        cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(stream.native())));
    return absl::OkStatus();
  }

 protected:
  void Free(void* data) override {
    // Free cannot report: an error here means the context is already broken.
    cudaSetDevice(device_);
    cudaFree(data);
  }

 private:
  static int64_t LogitsStride(int64_t v) { return (v + 15) / 16 * 16; }

  bool UseBf16Logits(const Problem& problem) const {
    return problem.dtype == DType::kBF16 && options_.bf16_logits;
  }

  Layout MakeLayoutForChunk(const Problem& problem, int64_t chunk) const {
    Layout l;
    l.chunk = chunk;
    l.ldl = LogitsStride(problem.v);
    l.logits_elem = UseBf16Logits(problem) ? 2 : 4;
    l.scalars_off = 0;
    l.row_loss_off = AlignUp(sizeof(RunScalars));
    l.cublas_off = l.row_loss_off + AlignUp(static_cast<size_t>(chunk) * sizeof(float));
    l.cublas_bytes = AlignUp(options_.cublas_workspace_bytes);
    l.logits_off = l.cublas_off + l.cublas_bytes;
    l.total = l.logits_off + static_cast<size_t>(chunk) * l.ldl * l.logits_elem;
    return l;
  }

  // The largest chunk that fits `bytes`, at most n; rounded down to a multiple of 256 rows when
  // the problem is split, so that the GEMMs' token dimension fills whole tiles.
  Layout MakeLayout(const Problem& problem, size_t bytes) const {
    const Layout one = MakeLayoutForChunk(problem, 1);
    if (bytes < one.total) return Layout{};
    const size_t per_row = static_cast<size_t>(one.ldl) * one.logits_elem + sizeof(float);
    // Estimate, then settle on the exact largest chunk (alignment padding makes the estimate off
    // by a row or two either way).
    int64_t chunk = std::clamp<int64_t>((bytes - one.logits_off) / per_row, 1, problem.n);
    while (chunk > 1 && MakeLayoutForChunk(problem, chunk).total > bytes) --chunk;
    while (chunk < problem.n && MakeLayoutForChunk(problem, chunk + 1).total <= bytes) ++chunk;
    if (chunk < problem.n && chunk >= 256) chunk = chunk / 256 * 256;
    return MakeLayoutForChunk(problem, chunk);
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes, Stream& stream) {
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    LOSSHEAD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault,
                                        static_cast<cudaStream_t>(stream.native())));
    return absl::OkStatus();
  }

  // TIn: H, W, dH and the gradient operand G; TL: the logits chunk as the first GEMM writes it.
  template <typename TIn, typename TL>
  absl::Status RunTyped(const Problem& problem, const Arguments& args, const Layout& layout,
                        CudaStream& cs) {
    const cudaStream_t stream = cs.stream();
    const cublasHandle_t handle = cs.handle();
    char* ws = static_cast<char*>(args.workspace);
    auto* scalars = reinterpret_cast<RunScalars*>(ws + layout.scalars_off);
    auto* row_loss = reinterpret_cast<float*>(ws + layout.row_loss_off);
    auto* logits = reinterpret_cast<TL*>(ws + layout.logits_off);
    auto* grad = reinterpret_cast<TIn*>(logits);  // G overwrites the logits in place
    const int64_t ldl = layout.ldl;
    const int64_t ldg = ldl * static_cast<int64_t>(sizeof(TL) / sizeof(TIn));
    const LossOptions& o = problem.options;
    const int n = static_cast<int>(problem.n);
    const int d = static_cast<int>(problem.d);
    const int v = static_cast<int>(problem.v);
    const auto* hidden = static_cast<const TIn*>(args.hidden);
    const auto* weight = static_cast<const TIn*>(args.weight);
    auto* grad_hidden = static_cast<TIn*>(args.grad_hidden);
    const bool need_grad = args.grad_hidden != nullptr || args.grad_weight != nullptr;
    constexpr cudaDataType_t kIn = CudaType<TIn>();
    constexpr cudaDataType_t kLogits = CudaType<TL>();
    static constexpr float kOne = 1.0f, kZero = 0.0f;

    LOSSHEAD_CUBLAS_CHECK(cublasSetWorkspace(handle, ws + layout.cublas_off, layout.cublas_bytes));
    LOSSHEAD_RETURN_IF_ERROR(cuda::LaunchCountTargets(
        args.targets, problem.n, problem.v, o.ignore_index, o.reduction == Reduction::kMean,
        o.grad_scale, args.token_count, scalars, stream));

    cuda::SoftmaxGradParams params;
    params.v = problem.v;
    params.ignore_index = o.ignore_index;
    params.label_smoothing = o.label_smoothing;
    params.z_loss = o.z_loss;
    params.softcap = o.softcap;

    for (int r0 = 0; r0 < n; r0 += static_cast<int>(layout.chunk)) {
      const int c = std::min(static_cast<int>(layout.chunk), n - r0);
      const TIn* h = hidden + static_cast<int64_t>(r0) * d;
      // Column-major view: logits^T (V x c, ld ldl) = W^T_cm(V x D) . H_cm (D x c).
      // Host alpha/beta here: with a device beta cuBLAS cannot know it is 0 and reads the whole
      // logits chunk back in its epilogue. Only the gradient GEMMs need the device alpha.
      LOSSHEAD_CUBLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
      LOSSHEAD_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, v, c, d, &kOne, weight,
                                         kIn, d, h, kIn, d, &kZero, logits, kLogits,
                                         static_cast<int>(ldl), CUBLAS_COMPUTE_32F,
                                         CUBLAS_GEMM_DEFAULT));
      LOSSHEAD_CUBLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_DEVICE));
      LOSSHEAD_RETURN_IF_ERROR((cuda::LaunchSoftmaxGrad<TL, TIn>(
          logits, ldl, c, args.targets + r0, params, need_grad ? grad : nullptr, ldg, row_loss,
          args.per_token_loss != nullptr ? args.per_token_loss + r0 : nullptr,
          args.per_token_lse != nullptr ? args.per_token_lse + r0 : nullptr, options_.row_threads,
          stream)));
      LOSSHEAD_RETURN_IF_ERROR(
          cuda::LaunchLossReduce(row_loss, c, scalars, args.loss_sum, stream));
      if (grad_hidden != nullptr) {
        // dH_cm (D x c) = W_cm (D x V) . G_cm (V x c, ld ldg).
        LOSSHEAD_CUBLAS_CHECK(cublasGemmEx(
            handle, CUBLAS_OP_N, CUBLAS_OP_N, d, c, v, &scalars->grad_alpha, weight, kIn, d, grad,
            kIn, static_cast<int>(ldg), &scalars->zero, grad_hidden + static_cast<int64_t>(r0) * d,
            kIn, d, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }
      if (args.grad_weight != nullptr) {
        // dW_cm (D x V) += H_cm (D x c) . G_cm^T (c x V).
        LOSSHEAD_CUBLAS_CHECK(cublasGemmEx(
            handle, CUBLAS_OP_N, CUBLAS_OP_T, d, v, c, &scalars->grad_alpha, h, kIn, d, grad, kIn,
            static_cast<int>(ldg), &scalars->one, args.grad_weight, CUDA_R_32F, d,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }
    }
    return absl::OkStatus();
  }

  const int device_;
  const CudaBackendOptions options_;
  const std::string description_;
};

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // a missing driver is "no device", not a sticky error
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  return CreateCudaBackend(device, CudaBackendOptions{});
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device,
                                                           const CudaBackendOptions& options) {
  const int count = CudaDeviceCount();
  if (device < 0 || device >= count) {
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", device, " does not exist (", count, " visible)"));
  }
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop;
  LOSSHEAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return std::unique_ptr<Backend>(
      new CudaBackend(device, options, absl::StrCat("cuda:", device, " (", prop.name, ")")));
}

}  // namespace losshead::kernels
