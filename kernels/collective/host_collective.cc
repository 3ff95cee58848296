#include "kernels/collective/host_collective.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace losshead::kernels {
namespace {

float* Floats(void* buffer) { return static_cast<float*>(buffer); }

// buffers[r][index] over every rank r, in rank order: the sum accumulated in fp64 and rounded
// to fp32 once, or the maximum (NaN when any input is NaN).
float ReduceElement(std::span<void* const> buffers, int64_t index, ReduceOp op) {
  if (op == ReduceOp::kSum) {
    // Starting from rank 0's value rather than 0.0 keeps -0 when every input is -0.
    double sum = Floats(buffers[0])[index];
    for (size_t r = 1; r < buffers.size(); ++r) sum += Floats(buffers[r])[index];
    return static_cast<float>(sum);
  }
  float max = Floats(buffers[0])[index];
  for (size_t r = 1; r < buffers.size(); ++r) {
    const float x = Floats(buffers[r])[index];
    if (x > max || std::isnan(x)) max = x;  // once NaN, nothing compares greater
  }
  return max;
}

void CopyBytes(void* dst, const void* src, size_t bytes) {
  // The same buffer may be passed for two ranks: copying it onto itself is a no-op, and memcpy's
  // contract excludes it.
  if (dst != src) std::memcpy(dst, src, bytes);
}

// Each call holds a lock while it runs, so that concurrent calls run whole, one after another, as
// the interface promises; the work is inline and nothing else is shared.
class HostCollective final : public Collective {
 public:
  explicit HostCollective(int size) : Collective(size) {}

 private:
  // Streams of CPU backends carry no native handle; one that does belongs to a device, whose
  // memory these loops cannot read.
  static absl::Status CheckHostStreams(absl::string_view call, std::span<Stream* const> streams) {
    for (size_t r = 0; r < streams.size(); ++r) {
      if (streams[r]->native() != nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(call, ": stream of rank ", r,
                         " is a device stream; this collective is for cpu backends"));
      }
    }
    return absl::OkStatus();
  }

  absl::Status DoAllReduce(std::span<void* const> buffers, int64_t count, DType, ReduceOp op,
                           std::span<Stream* const> streams) override {
    if (absl::Status s = CheckHostStreams("AllReduce", streams); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mu_);
    // Element by element, all reads before the writes, so that each rank's input is read intact.
    for (int64_t j = 0; j < count; ++j) {
      const float value = ReduceElement(buffers, j, op);
      for (void* buffer : buffers) Floats(buffer)[j] = value;
    }
    return absl::OkStatus();
  }

  absl::Status DoReduceScatter(std::span<void* const> buffers, std::span<const int64_t> counts,
                               std::span<const int64_t> offsets, DType,
                               std::span<Stream* const> streams) override {
    if (absl::Status s = CheckHostStreams("ReduceScatter", streams); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t r = 0; r < buffers.size(); ++r) {
      float* slice = Floats(buffers[r]);
      for (int64_t j = offsets[r]; j < offsets[r] + counts[r]; ++j) {
        slice[j] = ReduceElement(buffers, j, ReduceOp::kSum);
      }
    }
    return absl::OkStatus();
  }

  absl::Status DoAllGather(std::span<void* const> buffers, std::span<const int64_t> counts,
                           std::span<const int64_t> offsets, DType dtype,
                           std::span<Stream* const> streams) override {
    if (absl::Status s = CheckHostStreams("AllGather", streams); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mu_);
    const size_t element = DTypeSize(dtype);
    for (size_t r = 0; r < buffers.size(); ++r) {
      const size_t at = static_cast<size_t>(offsets[r]) * element;
      const size_t bytes = static_cast<size_t>(counts[r]) * element;
      for (size_t i = 0; i < buffers.size(); ++i) {
        if (i == r) continue;
        CopyBytes(static_cast<char*>(buffers[i]) + at, static_cast<const char*>(buffers[r]) + at,
                  bytes);
      }
    }
    return absl::OkStatus();
  }

  absl::Status DoBroadcast(std::span<void* const> buffers, int64_t count, DType dtype, int root,
                           std::span<Stream* const> streams) override {
    if (absl::Status s = CheckHostStreams("Broadcast", streams); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(mu_);
    const size_t bytes = static_cast<size_t>(count) * DTypeSize(dtype);
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (static_cast<int>(i) != root) CopyBytes(buffers[i], buffers[root], bytes);
    }
    return absl::OkStatus();
  }

  std::mutex mu_;
};

}  // namespace

std::unique_ptr<Collective> CreateHostCollective(int size) {
  return std::make_unique<HostCollective>(size);
}

}  // namespace losshead::kernels
