// CudaStream::Mark: a CUDA event recorded on the stream.
#include "kernels/cuda/cuda_stream.h"

#include <cuda_runtime.h>

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_check.h"

namespace losshead::kernels::cuda {
namespace {

class EventMark final : public StreamMark {
 public:
  EventMark(int device, cudaEvent_t event) : device_(device), event_(event) {}
  ~EventMark() override {
    cudaSetDevice(device_);
    cudaEventDestroy(event_);
  }
  EventMark(const EventMark&) = delete;
  EventMark& operator=(const EventMark&) = delete;

  // cudaEventSynchronize returns the errors of the work before the event (a fault of a kernel
  // enqueued ahead of it), as cudaStreamSynchronize would.
  absl::Status Wait() override {
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    LOSSHEAD_CUDA_CHECK(cudaEventSynchronize(event_));
    return absl::OkStatus();
  }

 private:
  const int device_;
  const cudaEvent_t event_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StreamMark>> CudaStream::Mark() {
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
  cudaEvent_t event = nullptr;
  LOSSHEAD_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  if (const cudaError_t err = cudaEventRecord(event, stream_); err != cudaSuccess) {
    cudaEventDestroy(event);
    return CudaError(err, "cudaEventRecord", __FILE__, __LINE__);
  }
  return std::unique_ptr<StreamMark>(std::make_unique<EventMark>(device_, event));
}

}  // namespace losshead::kernels::cuda
