// The CUDA backend's Stream: a CUDA stream with its cublasLt handle, the second stream and events
// of the overlapped schedule, and the scratch of SquaredNorm.
#ifndef LOSSHEAD_KERNELS_CUDA_CUDA_STREAM_H_
#define LOSSHEAD_KERNELS_CUDA_CUDA_STREAM_H_

#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <utility>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/lt_gemm.h"
#include "kernels/cuda/squared_norm.cuh"
#include "losshead/kernels/backend.h"

namespace losshead::kernels::cuda {

// A CUDA stream with its own cublasLt handle and GEMM plans: Run on different streams never
// shares them, and the mutex serialises two threads that enqueue on the same stream.
// The second stream and events serve the overlapped schedule (row kernel of one half of a chunk
// beside the GEMMs of the other): only Run, under the mutex, uses them.
class CudaStream final : public Stream {
 public:
  static constexpr int kEvents = 4;
  CudaStream(int device, cudaStream_t stream, std::unique_ptr<LtGemm> gemm)
      : device_(device), stream_(stream), gemm_(std::move(gemm)) {}
  ~CudaStream() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    if (side_ != nullptr) cudaStreamSynchronize(side_);
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (side_ != nullptr) cudaStreamDestroy(side_);
    if (norm_partials_ != nullptr) cudaFree(norm_partials_);
    gemm_.reset();
    cudaStreamDestroy(stream_);
  }

  absl::Status InitSide() {
    LOSSHEAD_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    for (cudaEvent_t& e : events_) {
      LOSSHEAD_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    // Allocated here rather than per call: cudaMalloc would synchronise the device.
    LOSSHEAD_CUDA_CHECK(cudaMalloc(&norm_partials_, sizeof(double) * kSquaredNormPartials));
    return absl::OkStatus();
  }
  // SquaredNorm's per-block partial sums; only used under the mutex.
  double* norm_partials() const { return norm_partials_; }
  cudaStream_t side() const { return side_; }
  cudaEvent_t event(int i) const { return events_[i]; }

  absl::Status Synchronize() override {
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    LOSSHEAD_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  void* native() const override { return stream_; }
  absl::StatusOr<std::unique_ptr<StreamMark>> Mark() override;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  LtGemm& gemm() { return *gemm_; }
  std::mutex& mutex() { return mu_; }

 private:
  const int device_;
  const cudaStream_t stream_;
  std::unique_ptr<LtGemm> gemm_;
  cudaStream_t side_ = nullptr;
  cudaEvent_t events_[kEvents] = {};
  double* norm_partials_ = nullptr;
  std::mutex mu_;
};

// `stream` as a CudaStream of `device`, or null when another backend made it.
inline CudaStream* AsCudaStream(Stream& stream, int device) {
  auto* cs = dynamic_cast<CudaStream*>(&stream);
  return cs != nullptr && cs->device() == device ? cs : nullptr;
}

inline absl::Status ForeignStreamError() {
  return absl::InvalidArgumentError("stream was not created by this CUDA backend");
}

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_CUDA_STREAM_H_
