// The implementation-independent half of the collectives: shard arithmetic, the checks every call
// makes before an implementation sees it, and the factory that picks the implementation.
#include "losshead/kernels/collective.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <set>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/collective/backend_kinds.h"
#include "kernels/collective/host_collective.h"
#include "kernels/collective/staged_collective.h"
#ifdef LOSSHEAD_HAVE_NCCL
#include "kernels/collective/nccl_collective.h"
#endif

namespace losshead::kernels {
namespace {

bool KnownDType(DType dtype) {
  return dtype == DType::kBF16 || dtype == DType::kFP16 || dtype == DType::kFP32;
}

// The checks shared by every call: one buffer and one stream per local rank, no null stream.
absl::Status CheckRanks(absl::string_view call, int k, int local, std::span<void* const> buffers,
                        std::span<Stream* const> streams) {
  const absl::string_view ranks = local == k ? " ranks" : " local ranks";
  if (buffers.size() != static_cast<size_t>(local)) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": ", buffers.size(), " buffers for ", local, ranks));
  }
  if (streams.size() != static_cast<size_t>(local)) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": ", streams.size(), " streams for ", local, ranks));
  }
  for (int r = 0; r < local; ++r) {
    if (streams[r] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(call, ": stream of rank ", r, " is null"));
    }
  }
  return absl::OkStatus();
}

// Every rank's buffer holds `elements` elements of `dtype`: none may be null when there are any,
// and their bytes must be addressable.
absl::Status CheckBuffers(absl::string_view call, std::span<void* const> buffers, int64_t elements,
                          DType dtype) {
  if (!KnownDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": unknown dtype ", static_cast<int>(dtype)));
  }
  const int64_t max_elements =
      std::numeric_limits<int64_t>::max() / static_cast<int64_t>(DTypeSize(dtype));
  if (elements > max_elements) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": ", elements, " elements of ",
                                                   DTypeName(dtype), " overflow a byte count"));
  }
  if (elements == 0) return absl::OkStatus();
  for (size_t r = 0; r < buffers.size(); ++r) {
    if (buffers[r] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(call, ": buffer of rank ", r, " is null with ", elements, " elements"));
    }
  }
  return absl::OkStatus();
}

// Sums and maxima are fp32 only: the reductions the heads need are over dW, softmax statistics
// and fp32 partial dH, and rounding a sum to bf16 per rank would lose what fp32 accumulation buys.
absl::Status CheckReducible(absl::string_view call, DType dtype) {
  if (KnownDType(dtype) && dtype != DType::kFP32) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": reduces fp32 only, got ", DTypeName(dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckCount(absl::string_view call, int64_t count) {
  if (count < 0) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": count ", count, " is negative"));
  }
  return absl::OkStatus();
}

// `counts` has one non-negative entry per rank; `offsets` gets their prefix sums and `total` the
// sum, which must not overflow.
absl::Status SliceOffsets(absl::string_view call, int k, std::span<const int64_t> counts,
                          std::vector<int64_t>* offsets, int64_t* total) {
  if (counts.size() != static_cast<size_t>(k)) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": ", counts.size(), " counts for ", k, " ranks"));
  }
  offsets->assign(k, 0);
  int64_t sum = 0;
  for (int r = 0; r < k; ++r) {
    if (counts[r] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(call, ": counts[", r, "] = ", counts[r], " is negative"));
    }
    if (counts[r] > std::numeric_limits<int64_t>::max() - sum) {
      return absl::InvalidArgumentError(absl::StrCat(call, ": the counts' sum overflows int64"));
    }
    (*offsets)[r] = sum;
    sum += counts[r];
  }
  *total = sum;
  return absl::OkStatus();
}

// The checks of a call with a root (Broadcast, Reduce): ranks, root, count and buffers.
absl::Status CheckRooted(absl::string_view call, int size, int local_size,
                         std::span<void* const> buffers, int64_t count, DType dtype, int root,
                         std::span<Stream* const> streams) {
  if (absl::Status s = CheckRanks(call, size, local_size, buffers, streams); !s.ok()) return s;
  if (root < 0 || root >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": root ", root, " is outside [0, ", size, ")"));
  }
  if (absl::Status s = CheckCount(call, count); !s.ok()) return s;
  return CheckBuffers(call, buffers, count, dtype);
}

}  // namespace

absl::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
  }
  return "unknown";
}

Shard ShardRange(int64_t total, int k, int i) {
  // total * i / k without the product, which overflows for large totals:
  // total = q k + m gives total i / k = q i + m i / k, and m i < k^2 fits easily.
  const auto boundary = [total, k](int64_t j) { return total / k * j + total % k * j / k; };
  return Shard{boundary(i), boundary(i + 1)};
}

std::vector<int64_t> ShardCounts(int64_t rows, int k, int64_t row_elements) {
  std::vector<int64_t> counts(k);
  for (int i = 0; i < k; ++i) counts[i] = ShardRange(rows, k, i).size() * row_elements;
  return counts;
}

absl::Status Collective::AllReduce(std::span<void* const> buffers, int64_t count, DType dtype,
                                   ReduceOp op, std::span<Stream* const> streams) {
  constexpr absl::string_view kCall = "AllReduce";
  if (absl::Status s = CheckRanks(kCall, size_, local_size_, buffers, streams); !s.ok()) return s;
  if (absl::Status s = CheckCount(kCall, count); !s.ok()) return s;
  if (absl::Status s = CheckBuffers(kCall, buffers, count, dtype); !s.ok()) return s;
  if (absl::Status s = CheckReducible(kCall, dtype); !s.ok()) return s;
  if (op != ReduceOp::kSum && op != ReduceOp::kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat(kCall, ": unknown reduce op ", static_cast<int>(op)));
  }
  if (count == 0) return absl::OkStatus();
  return DoAllReduce(buffers, count, dtype, op, streams);
}

absl::Status Collective::Reduce(std::span<void* const> buffers, int64_t count, DType dtype,
                                int root, std::span<Stream* const> streams) {
  constexpr absl::string_view kCall = "Reduce";
  if (absl::Status s = CheckRooted(kCall, size_, local_size_, buffers, count, dtype, root, streams);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckReducible(kCall, dtype); !s.ok()) return s;
  if (count == 0) return absl::OkStatus();
  return DoReduce(buffers, count, dtype, root, streams);
}

absl::Status Collective::ReduceScatter(std::span<void* const> buffers,
                                       std::span<const int64_t> counts, DType dtype,
                                       std::span<Stream* const> streams) {
  constexpr absl::string_view kCall = "ReduceScatter";
  if (absl::Status s = CheckRanks(kCall, size_, local_size_, buffers, streams); !s.ok()) return s;
  std::vector<int64_t> offsets;
  int64_t total = 0;
  if (absl::Status s = SliceOffsets(kCall, size_, counts, &offsets, &total); !s.ok()) return s;
  if (absl::Status s = CheckBuffers(kCall, buffers, total, dtype); !s.ok()) return s;
  if (absl::Status s = CheckReducible(kCall, dtype); !s.ok()) return s;
  if (total == 0) return absl::OkStatus();
  return DoReduceScatter(buffers, counts, offsets, dtype, streams);
}

absl::Status Collective::AllGather(std::span<void* const> buffers, std::span<const int64_t> counts,
                                   DType dtype, std::span<Stream* const> streams) {
  constexpr absl::string_view kCall = "AllGather";
  if (absl::Status s = CheckRanks(kCall, size_, local_size_, buffers, streams); !s.ok()) return s;
  std::vector<int64_t> offsets;
  int64_t total = 0;
  if (absl::Status s = SliceOffsets(kCall, size_, counts, &offsets, &total); !s.ok()) return s;
  if (absl::Status s = CheckBuffers(kCall, buffers, total, dtype); !s.ok()) return s;
  if (total == 0) return absl::OkStatus();
  return DoAllGather(buffers, counts, offsets, dtype, streams);
}

absl::Status Collective::Broadcast(std::span<void* const> buffers, int64_t count, DType dtype,
                                   int root, std::span<Stream* const> streams) {
  constexpr absl::string_view kCall = "Broadcast";
  if (absl::Status s = CheckRooted(kCall, size_, local_size_, buffers, count, dtype, root, streams);
      !s.ok()) {
    return s;
  }
  if (count == 0) return absl::OkStatus();
  return DoBroadcast(buffers, count, dtype, root, streams);
}

absl::StatusOr<std::unique_ptr<Collective>> CreateCollective(std::span<Backend* const> backends) {
  absl::StatusOr<BackendKinds> kinds = CountBackendKinds("CreateCollective", backends);
  if (!kinds.ok()) return kinds.status();
  const int cpu = kinds->cpu;
  const int cuda = kinds->cuda;
  const int k = static_cast<int>(backends.size());
  if (cpu > 0 && cuda > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CreateCollective: ", cpu, " cpu and ", cuda,
        " cuda backends: one collective spans backends of one kind (no host <-> device path)"));
  }
  if (cpu == k) return CreateHostCollective(k);

  std::vector<int> devices(k);
  for (int r = 0; r < k; ++r) {
    devices[r] = backends[r]->device_ordinal();
    if (devices[r] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("CreateCollective: cuda backend of rank ", r,
                                                     " (", backends[r]->device_description(),
                                                     ") names no device ordinal"));
    }
  }
  // Every rank on one device: NCCL refuses that, the host can stage it (slowly).
  if (k > 1 && std::count(devices.begin(), devices.end(), devices[0]) == k) {
    return CreateStagedCollective(backends);
  }
  std::set<int> seen;
  for (int r = 0; r < k; ++r) {
    if (!seen.insert(devices[r]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("CreateCollective: device ", devices[r], " appears twice (rank ", r,
                       "): NCCL takes one rank per device, and ranks share a device only when "
                       "all of them do"));
    }
  }
#ifdef LOSSHEAD_HAVE_NCCL
  return CreateNcclCollective(devices);
#else
  return absl::UnimplementedError(
      "CreateCollective: this build of losshead has no NCCL, so CUDA backends have no collective");
#endif
}

}  // namespace losshead::kernels
