#include "kernels/collective/staged_collective.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "kernels/collective/host_collective.h"

namespace losshead::kernels {
namespace {

// What the host collective asks of a stream: none of a device (its work runs inline).
class InlineStream final : public Stream {
 public:
  absl::Status Synchronize() override { return absl::OkStatus(); }
  void* native() const override { return nullptr; }
};

// One lock per call, as the host collective's: concurrent calls run whole, one after another, so
// every rank sees them in the same order.
class StagedCollective final : public Collective {
 public:
  explicit StagedCollective(std::span<Backend* const> backends)
      : Collective(static_cast<int>(backends.size())),
        backends_(backends.begin(), backends.end()),
        host_(CreateHostCollective(size())),
        inline_streams_(size()),
        copies_(size()) {
    for (InlineStream& s : inline_streams_) inline_ptrs_.push_back(&s);
  }

 private:
  using HostCall = absl::FunctionRef<absl::Status(std::span<void* const> host_buffers,
                                                  std::span<Stream* const> host_streams)>;

  // Copies the first `bytes` of every rank's buffer to the host once its stream has reached this
  // call, runs `call` on the copies, and copies them back; returns once they are back.
  absl::Status Staged(std::span<void* const> buffers, size_t bytes,
                      std::span<Stream* const> streams, HostCall call) {
    std::lock_guard<std::mutex> lock(mu_);
    const int k = size();
    std::vector<void*> host(k);
    for (int r = 0; r < k; ++r) {
      copies_[r].resize(bytes);
      host[r] = copies_[r].data();
      if (absl::Status s = backends_[r]->CopyToHost(host[r], buffers[r], bytes, *streams[r]);
          !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = SynchronizeAll(streams); !s.ok()) return s;
    if (absl::Status s = call(host, inline_ptrs_); !s.ok()) return s;
    for (int r = 0; r < k; ++r) {
      if (absl::Status s = backends_[r]->CopyToDevice(buffers[r], host[r], bytes, *streams[r]);
          !s.ok()) {
        return s;
      }
    }
    // The copies read `copies_`, which the next call overwrites.
    return SynchronizeAll(streams);
  }

  static absl::Status SynchronizeAll(std::span<Stream* const> streams) {
    for (Stream* stream : streams) {
      if (absl::Status s = stream->Synchronize(); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  static size_t Total(std::span<const int64_t> counts, std::span<const int64_t> offsets,
                      DType dtype) {
    return static_cast<size_t>(offsets.back() + counts.back()) * DTypeSize(dtype);
  }

  absl::Status DoAllReduce(std::span<void* const> buffers, int64_t count, DType dtype, ReduceOp op,
                           std::span<Stream* const> streams) override {
    return Staged(buffers, static_cast<size_t>(count) * DTypeSize(dtype), streams,
                  [&](std::span<void* const> host, std::span<Stream* const> inline_streams) {
                    return host_->AllReduce(host, count, dtype, op, inline_streams);
                  });
  }

  absl::Status DoReduceScatter(std::span<void* const> buffers, std::span<const int64_t> counts,
                               std::span<const int64_t> offsets, DType dtype,
                               std::span<Stream* const> streams) override {
    return Staged(buffers, Total(counts, offsets, dtype), streams,
                  [&](std::span<void* const> host, std::span<Stream* const> inline_streams) {
                    return host_->ReduceScatter(host, counts, dtype, inline_streams);
                  });
  }

  absl::Status DoAllGather(std::span<void* const> buffers, std::span<const int64_t> counts,
                           std::span<const int64_t> offsets, DType dtype,
                           std::span<Stream* const> streams) override {
    return Staged(buffers, Total(counts, offsets, dtype), streams,
                  [&](std::span<void* const> host, std::span<Stream* const> inline_streams) {
                    return host_->AllGather(host, counts, dtype, inline_streams);
                  });
  }

  absl::Status DoBroadcast(std::span<void* const> buffers, int64_t count, DType dtype, int root,
                           std::span<Stream* const> streams) override {
    return Staged(buffers, static_cast<size_t>(count) * DTypeSize(dtype), streams,
                  [&](std::span<void* const> host, std::span<Stream* const> inline_streams) {
                    return host_->Broadcast(host, count, dtype, root, inline_streams);
                  });
  }

  const std::vector<Backend*> backends_;
  const std::unique_ptr<Collective> host_;
  std::vector<InlineStream> inline_streams_;
  std::vector<Stream*> inline_ptrs_;
  std::mutex mu_;
  std::vector<std::vector<std::byte>> copies_;  // one per rank, reused
};

}  // namespace

std::unique_ptr<Collective> CreateStagedCollective(std::span<Backend* const> backends) {
  return std::make_unique<StagedCollective>(backends);
}

}  // namespace losshead::kernels
