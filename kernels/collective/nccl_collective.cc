// NCCL has no uneven reduce-scatter or all-gather: slices of different sizes become one
// ncclReduce (or ncclBroadcast) per slice, rooted at the slice's owner, all in one group so that
// NCCL runs them as one operation. Even slices use ncclReduceScatter / ncclAllGather, whose
// in-place layout is exactly ours.
#include "kernels/collective/nccl_collective.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace losshead::kernels {
namespace {

absl::Status NcclError(ncclResult_t result, const char* call, const char* file, int line) {
  std::string message =
      absl::StrCat(file, ":", line, ": ", call, " failed: ", ncclGetErrorString(result));
  // The detail of the last failure in this process (NCCL keeps it per thread, not per comm).
  const char* detail = ncclGetLastError(nullptr);
  if (detail != nullptr && detail[0] != '\0') absl::StrAppend(&message, " (", detail, ")");
  if (result == ncclInvalidArgument || result == ncclInvalidUsage) {
    return absl::InvalidArgumentError(message);
  }
  return absl::InternalError(message);
}

#define LOSSHEAD_NCCL_CHECK(expr)                                         \
  do {                                                                    \
    const ncclResult_t losshead_nccl_result_ = (expr);                    \
    if (losshead_nccl_result_ != ncclSuccess) {                           \
      return NcclError(losshead_nccl_result_, #expr, __FILE__, __LINE__); \
    }                                                                     \
  } while (0)

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kFP16:
      return ncclFloat16;
    case DType::kFP32:
      return ncclFloat32;
  }
  return ncclFloat32;  // not reached: the dtype was validated
}

ncclRedOp_t NcclOp(ReduceOp op) { return op == ReduceOp::kMax ? ncclMax : ncclSum; }

// NCCL and the CUDA calls here switch the current device; the caller's is put back.
class CurrentDeviceGuard {
 public:
  CurrentDeviceGuard() {
    if (cudaGetDevice(&saved_) != cudaSuccess) saved_ = -1;
  }
  ~CurrentDeviceGuard() {
    if (saved_ >= 0) cudaSetDevice(saved_);
  }
  CurrentDeviceGuard(const CurrentDeviceGuard&) = delete;
  CurrentDeviceGuard& operator=(const CurrentDeviceGuard&) = delete;

 private:
  int saved_ = -1;
};

// A CUDA error found while checking the caller's arguments is the caller's: report it as such
// and clear it, so that the next CUDA call does not see it.
absl::Status ArgumentCudaError(absl::string_view what, cudaError_t err) {
  cudaGetLastError();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

char* At(void* buffer, int64_t elements, DType dtype) {
  return static_cast<char*>(buffer) + elements * static_cast<int64_t>(DTypeSize(dtype));
}

bool AllEqual(std::span<const int64_t> counts) {
  for (int64_t c : counts) {
    if (c != counts[0]) return false;
  }
  return true;
}

class NcclCollective final : public Collective {
 public:
  NcclCollective(std::vector<int> devices, std::vector<ncclComm_t> comms)
      : Collective(static_cast<int>(devices.size())),
        devices_(std::move(devices)),
        comms_(std::move(comms)) {}

  ~NcclCollective() override {
    // Finalizing flushes each communicator's outstanding work and waits for its peers: with every
    // rank in this thread, one at a time would wait for the others forever, so all of them go in
    // one group. Nothing can be reported from here: failures leave the process's resources to
    // its exit.
    CurrentDeviceGuard guard;
    ncclGroupStart();
    for (ncclComm_t comm : comms_) ncclCommFinalize(comm);
    ncclGroupEnd();
    for (ncclComm_t comm : comms_) ncclCommDestroy(comm);
  }

 private:
  absl::Status DoAllReduce(std::span<void* const> buffers, int64_t count, DType dtype, ReduceOp op,
                           std::span<Stream* const> streams) override {
    return Issue("AllReduce", buffers, streams, [&](int r, cudaStream_t stream) {
      LOSSHEAD_NCCL_CHECK(ncclAllReduce(buffers[r], buffers[r], static_cast<size_t>(count),
                                        NcclType(dtype), NcclOp(op), comms_[r], stream));
      return absl::OkStatus();
    });
  }

  absl::Status DoReduceScatter(std::span<void* const> buffers, std::span<const int64_t> counts,
                               std::span<const int64_t> offsets, DType dtype,
                               std::span<Stream* const> streams) override {
    if (AllEqual(counts)) {
      // In place: rank r receives at its own offset, r * count, of the buffer it sends.
      return Issue("ReduceScatter", buffers, streams, [&](int r, cudaStream_t stream) {
        LOSSHEAD_NCCL_CHECK(ncclReduceScatter(buffers[r], At(buffers[r], offsets[r], dtype),
                                              static_cast<size_t>(counts[r]), NcclType(dtype),
                                              ncclSum, comms_[r], stream));
        return absl::OkStatus();
      });
    }
    // Every rank takes part in every slice's reduce, in slice order, so that each communicator
    // sees the same sequence; only the owner's copy of a slice is written (in place at the root).
    return Issue("ReduceScatter", buffers, streams, [&](int r, cudaStream_t stream) {
      for (int owner = 0; owner < size(); ++owner) {
        if (counts[owner] == 0) continue;
        char* slice = At(buffers[r], offsets[owner], dtype);
        LOSSHEAD_NCCL_CHECK(ncclReduce(slice, slice, static_cast<size_t>(counts[owner]),
                                       NcclType(dtype), ncclSum, owner, comms_[r], stream));
      }
      return absl::OkStatus();
    });
  }

  absl::Status DoAllGather(std::span<void* const> buffers, std::span<const int64_t> counts,
                           std::span<const int64_t> offsets, DType dtype,
                           std::span<Stream* const> streams) override {
    if (AllEqual(counts)) {
      // In place: rank r sends from its own offset, r * count, of the buffer it receives into.
      return Issue("AllGather", buffers, streams, [&](int r, cudaStream_t stream) {
        LOSSHEAD_NCCL_CHECK(ncclAllGather(At(buffers[r], offsets[r], dtype), buffers[r],
                                          static_cast<size_t>(counts[r]), NcclType(dtype),
                                          comms_[r], stream));
        return absl::OkStatus();
      });
    }
    return Issue("AllGather", buffers, streams, [&](int r, cudaStream_t stream) {
      for (int owner = 0; owner < size(); ++owner) {
        if (counts[owner] == 0) continue;
        char* slice = At(buffers[r], offsets[owner], dtype);
        LOSSHEAD_NCCL_CHECK(ncclBroadcast(slice, slice, static_cast<size_t>(counts[owner]),
                                          NcclType(dtype), owner, comms_[r], stream));
      }
      return absl::OkStatus();
    });
  }

  absl::Status DoBroadcast(std::span<void* const> buffers, int64_t count, DType dtype, int root,
                           std::span<Stream* const> streams) override {
    return Issue("Broadcast", buffers, streams, [&](int r, cudaStream_t stream) {
      LOSSHEAD_NCCL_CHECK(ncclBroadcast(buffers[r], buffers[r], static_cast<size_t>(count),
                                        NcclType(dtype), root, comms_[r], stream));
      return absl::OkStatus();
    });
  }

  // Checks that every rank's stream and buffer are on its device, then runs issue(r, stream) for
  // every rank inside one NCCL group: one thread drives every device, and outside a group the
  // first rank's call would wait for the others. A failure inside the group still ends it, which
  // drops what was queued in it.
  template <typename IssueRank>
  absl::Status Issue(absl::string_view call, std::span<void* const> buffers,
                     std::span<Stream* const> streams, const IssueRank& issue) {
    std::vector<cudaStream_t> native(size());
    CurrentDeviceGuard guard;
    for (int r = 0; r < size(); ++r) {
      absl::StatusOr<cudaStream_t> stream = CheckPlacement(call, r, buffers[r], *streams[r]);
      if (!stream.ok()) return stream.status();
      native[r] = *stream;
    }
    std::lock_guard<std::mutex> lock(IssueMutex());
    absl::Status status = [&]() -> absl::Status {
      LOSSHEAD_NCCL_CHECK(ncclGroupStart());
      absl::Status issued;
      for (int r = 0; r < size() && issued.ok(); ++r) issued = issue(r, native[r]);
      const ncclResult_t end = ncclGroupEnd();
      if (!issued.ok()) return issued;
      if (end != ncclSuccess) return NcclError(end, "ncclGroupEnd()", __FILE__, __LINE__);
      return absl::OkStatus();
    }();
    if (status.ok()) return status;
    return absl::Status(status.code(), absl::StrCat(call, ": ", status.message()));
  }

  // Rank r's CUDA stream when it and `buffer` are on rank r's device; INVALID_ARGUMENT otherwise.
  absl::StatusOr<cudaStream_t> CheckPlacement(absl::string_view call, int r, void* buffer,
                                              Stream& stream) const {
    const int device = devices_[r];
    auto cuda_stream = static_cast<cudaStream_t>(stream.native());
    if (cuda_stream == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(call, ": stream of rank ", r, " is not a CUDA stream"));
    }
    int stream_device = -1;
    if (cudaError_t err = cudaStreamGetDevice(cuda_stream, &stream_device); err != cudaSuccess) {
      return ArgumentCudaError(absl::StrCat(call, ": stream of rank ", r), err);
    }
    if (stream_device != device) {
      return absl::InvalidArgumentError(absl::StrCat(call, ": stream of rank ", r, " is on device ",
                                                     stream_device, ", rank ", r, " is device ",
                                                     device));
    }
    cudaPointerAttributes attributes;
    if (cudaError_t err = cudaPointerGetAttributes(&attributes, buffer); err != cudaSuccess) {
      return ArgumentCudaError(absl::StrCat(call, ": buffer of rank ", r), err);
    }
    const bool on_device = attributes.type == cudaMemoryTypeManaged ||
                           (attributes.type == cudaMemoryTypeDevice && attributes.device == device);
    if (!on_device) {
      return absl::InvalidArgumentError(absl::StrCat(
          call, ": buffer of rank ", r, " is not memory of device ", device, " (memory type ",
          static_cast<int>(attributes.type), ", device ", attributes.device, ")"));
    }
    return cuda_stream;
  }

  const std::vector<int> devices_;
  const std::vector<ncclComm_t> comms_;
  // Calls go into NCCL one whole group at a time, those of every collective in the process (every
  // placed head has its own): a communicator takes one thread at a time, and NCCL asks that the
  // operations of communicators sharing devices reach every device in the same order.
  static std::mutex& IssueMutex() {
    static std::mutex* const mu = new std::mutex;
    return *mu;
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Collective>> CreateNcclCollective(std::span<const int> devices) {
  // NVLink multicast (NVLS) stays off. Multicast objects are a resource of the whole host, shared
  // by every process and tenant on its GPUs: a process that fails while holding them can leave
  // every GPU of the host out of service for a long time. NVLS also reserves device memory per
  // communicator, outside any budget. NCCL reads its variables when it initialises, so this comes
  // before the first communicator; a setting already in the environment is left as it is.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  int visible = 0;
  if (cudaGetDeviceCount(&visible) != cudaSuccess) {
    cudaGetLastError();  // no driver: no device, not a sticky error
    visible = 0;
  }
  for (size_t r = 0; r < devices.size(); ++r) {
    if (devices[r] < 0 || devices[r] >= visible) {
      return absl::InvalidArgumentError(absl::StrCat("CreateCollective: device ", devices[r],
                                                     " of rank ", r, " does not exist (", visible,
                                                     " visible)"));
    }
  }
  CurrentDeviceGuard guard;
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  LOSSHEAD_NCCL_CHECK(
      ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()));
  return std::unique_ptr<Collective>(
      new NcclCollective(std::vector<int>(devices.begin(), devices.end()), std::move(comms)));
}

}  // namespace losshead::kernels
