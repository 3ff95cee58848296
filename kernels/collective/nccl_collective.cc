// NCCL has no uneven reduce-scatter or all-gather: slices of different sizes become one
// ncclReduce (or ncclBroadcast) per slice, rooted at the slice's owner, all in one group so that
// NCCL runs them as one operation. Even slices use ncclReduceScatter / ncclAllGather, whose
// in-place layout is exactly ours.
#include "kernels/collective/nccl_collective.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

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
  // Within one process: every rank is local.
  NcclCollective(std::vector<int> devices, std::vector<ncclComm_t> comms)
      : Collective(static_cast<int>(devices.size())),
        devices_(std::move(devices)),
        comms_(std::move(comms)) {}

  // Across the processes of `group`: the local ranks are first_rank, ..., of `size`; a watchdog
  // turns work that does not finish within the group's op timeout, or an asynchronous NCCL error,
  // into an abort of the communicators and UNAVAILABLE.
  NcclCollective(std::vector<int> devices, std::vector<ncclComm_t> comms, int size, int first_rank,
                 std::shared_ptr<ProcessGroup> group)
      : Collective(size, static_cast<int>(devices.size()), first_rank),
        devices_(std::move(devices)),
        comms_(std::move(comms)),
        group_(std::move(group)) {
    watchdog_ = std::thread([this] { Watch(); });
  }

  ~NcclCollective() override {
    if (watchdog_.joinable()) {
      {
        absl::MutexLock lock(&watch_mu_);
        stopping_ = true;
      }
      watchdog_.join();
    }
    CurrentDeviceGuard guard;
    for (Pending& pending : pending_) DestroyEvents(pending.events);
    // A communicator whose peer is gone cannot be finalized (finalizing waits for the peers): a
    // broken group's communicators are aborted instead.
    const bool abort = aborted_ || (group_ != nullptr && !group_->health().ok());
    if (abort) {
      if (!aborted_) {
        for (ncclComm_t comm : comms_) ncclCommAbort(comm);
      }
      return;
    }
    // Finalizing flushes each communicator's outstanding work and waits for its peers: with every
    // rank in this thread, one at a time would wait for the others forever, so all of them go in
    // one group. Nothing can be reported from here: failures leave the process's resources to
    // its exit.
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

  absl::Status DoReduce(std::span<void* const> buffers, int64_t count, DType dtype, int root,
                        std::span<Stream* const> streams) override {
    // In place at the root; the other ranks only send.
    return Issue("Reduce", buffers, streams, [&](int r, cudaStream_t stream) {
      LOSSHEAD_NCCL_CHECK(ncclReduce(buffers[r], buffers[r], static_cast<size_t>(count),
                                     NcclType(dtype), ncclSum, root, comms_[r], stream));
      return absl::OkStatus();
    });
  }

  absl::Status DoReduceScatter(std::span<void* const> buffers, std::span<const int64_t> counts,
                               std::span<const int64_t> offsets, DType dtype,
                               std::span<Stream* const> streams) override {
    if (AllEqual(counts)) {
      // In place: rank r receives at its own offset, r * count, of the buffer it sends.
      return Issue("ReduceScatter", buffers, streams, [&](int r, cudaStream_t stream) {
        const int g = first_rank() + r;
        LOSSHEAD_NCCL_CHECK(ncclReduceScatter(buffers[r], At(buffers[r], offsets[g], dtype),
                                              static_cast<size_t>(counts[g]), NcclType(dtype),
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
        const int g = first_rank() + r;
        LOSSHEAD_NCCL_CHECK(ncclAllGather(At(buffers[r], offsets[g], dtype), buffers[r],
                                          static_cast<size_t>(counts[g]), NcclType(dtype),
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
    if (absl::Status broken = health(); !broken.ok()) {
      return absl::UnavailableError(
          absl::StrCat(call, ": the collective is unusable (", broken.message(), ")"));
    }
    std::vector<cudaStream_t> native(local_size());
    CurrentDeviceGuard guard;
    for (int r = 0; r < local_size(); ++r) {
      absl::StatusOr<cudaStream_t> stream = CheckPlacement(call, r, buffers[r], *streams[r]);
      if (!stream.ok()) return stream.status();
      native[r] = *stream;
    }
    std::lock_guard<std::mutex> lock(IssueMutex());
    absl::Status status = [&]() -> absl::Status {
      LOSSHEAD_NCCL_CHECK(ncclGroupStart());
      absl::Status issued;
      for (int r = 0; r < local_size() && issued.ok(); ++r) issued = issue(r, native[r]);
      const ncclResult_t end = ncclGroupEnd();
      if (!issued.ok()) return issued;
      if (end != ncclSuccess) return NcclError(end, "ncclGroupEnd()", __FILE__, __LINE__);
      return Watched(call, native);
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

  // Work enqueued by one call, watched until every local stream has passed it.
  struct Pending {
    std::string call;
    std::vector<cudaEvent_t> events;  // one per local rank
    absl::Time issued;
  };

  static void DestroyEvents(std::vector<cudaEvent_t>& events) {
    for (cudaEvent_t event : events) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    events.clear();
  }

  absl::Status health() const {
    absl::MutexLock lock(&watch_mu_);
    return broken_;
  }

  // Across processes: an event after the call's work on every local stream, for the watchdog.
  absl::Status Watched(absl::string_view call, std::span<const cudaStream_t> streams) {
    if (group_ == nullptr) return absl::OkStatus();
    Pending pending{std::string(call), std::vector<cudaEvent_t>(streams.size(), nullptr),
                    absl::Now()};
    for (size_t r = 0; r < streams.size(); ++r) {
      cudaSetDevice(devices_[r]);
      if (cudaEventCreateWithFlags(&pending.events[r], cudaEventDisableTiming) != cudaSuccess ||
          cudaEventRecord(pending.events[r], streams[r]) != cudaSuccess) {
        const cudaError_t err = cudaGetLastError();
        DestroyEvents(pending.events);
        return absl::InternalError(
            absl::StrCat(call, ": cannot watch the call: ", cudaGetErrorString(err)));
      }
    }
    absl::MutexLock lock(&watch_mu_);
    pending_.push_back(std::move(pending));
    return absl::OkStatus();
  }

  // Every 20 ms: drops the calls whose work is done; aborts every communicator when the oldest
  // call has run past the group's op timeout or NCCL reports an asynchronous error (a peer that
  // died, a network failure). After that every call is UNAVAILABLE, and the group is shut down
  // so that the peers' exchanges fail too rather than wait.
  void Watch() {
    CurrentDeviceGuard guard;
    while (true) {
      absl::MutexLock lock(&watch_mu_);
      if (watch_mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(20))) return;
      if (aborted_) continue;
      std::string why;
      while (!pending_.empty()) {
        Pending& front = pending_.front();
        bool done = true;
        for (size_t r = 0; r < front.events.size() && done; ++r) {
          cudaSetDevice(devices_[r]);
          done = cudaEventQuery(front.events[r]) == cudaSuccess;
        }
        if (!done) {
          if (absl::Now() - front.issued > group_->op_timeout()) {
            why = absl::StrCat(front.call, " did not complete within ",
                               absl::FormatDuration(group_->op_timeout()));
          }
          break;
        }
        DestroyEvents(front.events);
        pending_.pop_front();
      }
      for (size_t r = 0; r < comms_.size() && why.empty(); ++r) {
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(comms_[r], &async) == ncclSuccess && async != ncclSuccess &&
            async != ncclInProgress) {
          why = absl::StrCat("NCCL reported ", ncclGetErrorString(async), " on local rank ", r);
        }
      }
      if (why.empty()) continue;
      broken_ = absl::UnavailableError(why);
      aborted_ = true;
      for (ncclComm_t comm : comms_) ncclCommAbort(comm);
      group_->Shutdown();
    }
  }

  const std::vector<int> devices_;
  const std::vector<ncclComm_t> comms_;
  const std::shared_ptr<ProcessGroup> group_;  // null within one process
  mutable absl::Mutex watch_mu_;
  absl::Status broken_ ABSL_GUARDED_BY(watch_mu_);
  std::deque<Pending> pending_ ABSL_GUARDED_BY(watch_mu_);
  bool stopping_ ABSL_GUARDED_BY(watch_mu_) = false;
  bool aborted_ = false;  // written by the watchdog before it stops; read after its join
  std::thread watchdog_;
  // Calls go into NCCL one whole group at a time, those of every collective in the process (every
  // placed head has its own): a communicator takes one thread at a time, and NCCL asks that the
  // operations of communicators sharing devices reach every device in the same order.
  static std::mutex& IssueMutex() {
    static std::mutex* const mu = new std::mutex;
    return *mu;
  }
};

}  // namespace

absl::Status CheckNcclDevices(std::span<const int> devices) {
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
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Collective>> CreateNcclCollective(std::span<const int> devices) {
  if (absl::Status s = CheckNcclDevices(devices); !s.ok()) return s;
  CurrentDeviceGuard guard;
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  LOSSHEAD_NCCL_CHECK(
      ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data()));
  return std::unique_ptr<Collective>(
      new NcclCollective(std::vector<int>(devices.begin(), devices.end()), std::move(comms)));
}

absl::StatusOr<std::unique_ptr<Collective>> CreateProcessNcclCollective(
    std::shared_ptr<ProcessGroup> group, std::span<const int> devices, std::vector<int> first) {
  // Global rank 0 (process 0's first device) makes the id; the group hands it to everyone, with a
  // flag saying whether making it worked, so that a failure there is not a wait elsewhere.
  struct IdMessage {
    uint32_t ok = 0;
    ncclUniqueId id;
  };
  IdMessage mine;
  std::memset(&mine, 0, sizeof(mine));
  ncclResult_t made = ncclSuccess;
  if (group->rank() == 0) {
    made = ncclGetUniqueId(&mine.id);
    mine.ok = made == ncclSuccess ? 1 : 0;
  }
  std::byte bytes[sizeof(IdMessage)];
  std::memcpy(bytes, &mine, sizeof(mine));
  absl::StatusOr<std::vector<std::vector<std::byte>>> all =
      group->AllGather("CreateProcessCollective: NCCL id", bytes);
  if (!all.ok()) return all.status();
  if (made != ncclSuccess) return NcclError(made, "ncclGetUniqueId()", __FILE__, __LINE__);
  IdMessage root;
  std::memcpy(&root, (*all)[0].data(), sizeof(root));
  if (root.ok == 0) {
    return absl::UnavailableError(
        "CreateProcessCollective: process 0 could not make an NCCL unique id");
  }
  const int size = first.back();
  const int first_rank = first[group->rank()];
  CurrentDeviceGuard guard;
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  // Every local device joins in one group: ncclCommInitRank waits for all ranks of the clique,
  // and this thread holds several of them.
  LOSSHEAD_NCCL_CHECK(ncclGroupStart());
  ncclResult_t init = ncclSuccess;
  for (size_t r = 0; r < devices.size() && init == ncclSuccess; ++r) {
    if (cudaSetDevice(devices[r]) != cudaSuccess) {
      cudaGetLastError();
      init = ncclUnhandledCudaError;
      break;
    }
    init = ncclCommInitRank(&comms[r], size, root.id, first_rank + static_cast<int>(r));
  }
  const ncclResult_t end = ncclGroupEnd();
  if (init != ncclSuccess) return NcclError(init, "ncclCommInitRank()", __FILE__, __LINE__);
  if (end != ncclSuccess) {
    return NcclError(end, "ncclGroupEnd() after ncclCommInitRank", __FILE__, __LINE__);
  }
  return std::unique_ptr<Collective>(
      new NcclCollective(std::vector<int>(devices.begin(), devices.end()), std::move(comms), size,
                         first_rank, std::move(group)));
}

}  // namespace losshead::kernels
