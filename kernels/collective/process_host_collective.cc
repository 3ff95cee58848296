// Who reduces what: an AllReduce's elements are split over the processes (ShardRange), each process
// sums its part over every rank and sends the result back; a ReduceScatter's slices are summed by
// the process that owns them. Either way one process adds each element's terms in global rank
// order, so the bits are the one-process host collective's. Traffic per process is about the
// buffer's size times its local ranks, not times the number of processes.
#include "kernels/collective/process_host_collective.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/collective/call_header.h"

namespace losshead::kernels {
namespace {

using ByteVector = std::vector<std::byte>;

// memcpy that takes empty ranges, whose pointers may be null (an empty part's vector).
void Copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

char* At(void* buffer, int64_t elements, size_t element_size) {
  return static_cast<char*>(buffer) + static_cast<size_t>(elements) * element_size;
}

// terms[0..n) reduced as the host collective does: fp64 sum from the first term (which keeps -0
// when every term is -0), rounded once; or the maximum, NaN when any term is NaN.
float ReduceTerms(const float* terms, size_t n, ReduceOp op) {
  if (op == ReduceOp::kSum) {
    double sum = terms[0];
    for (size_t r = 1; r < n; ++r) sum += terms[r];
    return static_cast<float>(sum);
  }
  float max = terms[0];
  for (size_t r = 1; r < n; ++r) {
    if (terms[r] > max || std::isnan(terms[r])) max = terms[r];
  }
  return max;
}

class ProcessHostCollective final : public Collective {
 public:
  ProcessHostCollective(std::shared_ptr<ProcessGroup> group, std::vector<int> first)
      : Collective(first.back(), first[group->rank() + 1] - first[group->rank()],
                   first[group->rank()]),
        group_(std::move(group)),
        first_(std::move(first)),
        me_(group_->rank()),
        processes_(group_->size()) {}

 private:
  int Local(int p) const { return first_[p + 1] - first_[p]; }

  // Streams of CPU backends carry no native handle; one that does belongs to a device.
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

  // The checks and the header agreement every call starts with; `header` gets the sequence number.
  absl::Status Begin(absl::string_view call, std::span<Stream* const> streams, CallHeader header) {
    if (absl::Status s = CheckHostStreams(call, streams); !s.ok()) return s;
    header.sequence = sequence_++;
    what_ = absl::StrCat(call, " #", header.sequence);
    return AgreeOnCall(*group_, what_, header);
  }

  // One all-to-all round: sends[q] to process q, recvs[q] (already sized) from it.
  absl::Status Swap(const std::vector<ByteVector>& sends, std::vector<ByteVector>& recvs) {
    std::vector<std::span<const std::byte>> out(processes_);
    std::vector<std::span<std::byte>> in(processes_);
    for (int q = 0; q < processes_; ++q) {
      if (q == me_) continue;
      out[q] = sends[q];
      in[q] = recvs[q];
    }
    return group_->Exchange(what_, out, in);
  }

  absl::Status DoAllReduce(std::span<void* const> buffers, int64_t count, DType dtype, ReduceOp op,
                           std::span<Stream* const> streams) override {
    std::lock_guard<std::mutex> lock(mu_);
    CallHeader header;
    header.kind = static_cast<uint32_t>(CallKind::kAllReduce);
    header.dtype = static_cast<uint32_t>(dtype);
    header.op = static_cast<uint32_t>(op);
    header.count = count;
    if (absl::Status s = Begin("AllReduce", streams, header); !s.ok()) return s;
    const int local = local_size();
    // Round 1: process q gets every rank's elements of its part, ShardRange(count, P, q).
    std::vector<ByteVector> sends(processes_), recvs(processes_);
    const Shard mine = ShardRange(count, processes_, me_);
    for (int q = 0; q < processes_; ++q) {
      const Shard part = ShardRange(count, processes_, q);
      const size_t bytes = static_cast<size_t>(part.size()) * sizeof(float);
      if (q == me_) continue;
      sends[q].resize(bytes * local);
      for (int i = 0; i < local; ++i) {
        Copy(sends[q].data() + i * bytes, At(buffers[i], part.begin, sizeof(float)), bytes);
      }
      recvs[q].resize(static_cast<size_t>(mine.size()) * sizeof(float) * Local(q));
    }
    if (absl::Status s = Swap(sends, recvs); !s.ok()) return s;
    // Reduce this process's part over the ranks in global order.
    std::vector<float> result(mine.size());
    std::vector<float> terms(size());
    for (int64_t j = 0; j < mine.size(); ++j) {
      int g = 0;
      for (int p = 0; p < processes_; ++p) {
        for (int i = 0; i < Local(p); ++i, ++g) {
          if (p == me_) {
            Copy(&terms[g], At(buffers[i], mine.begin + j, sizeof(float)), sizeof(float));
          } else {
            Copy(&terms[g], recvs[p].data() + (i * mine.size() + j) * sizeof(float), sizeof(float));
          }
        }
      }
      result[j] = ReduceTerms(terms.data(), terms.size(), op);
    }
    // Round 2: every process gets every part's result.
    for (int q = 0; q < processes_; ++q) {
      if (q == me_) continue;
      sends[q].assign(reinterpret_cast<const std::byte*>(result.data()),
                      reinterpret_cast<const std::byte*>(result.data() + result.size()));
      recvs[q].resize(static_cast<size_t>(ShardRange(count, processes_, q).size()) * sizeof(float));
    }
    if (absl::Status s = Swap(sends, recvs); !s.ok()) return s;
    for (int i = 0; i < local; ++i) {
      for (int q = 0; q < processes_; ++q) {
        const Shard part = ShardRange(count, processes_, q);
        const void* from = q == me_ ? static_cast<const void*>(result.data()) : recvs[q].data();
        Copy(At(buffers[i], part.begin, sizeof(float)), from, part.size() * sizeof(float));
      }
    }
    return absl::OkStatus();
  }

  // Elements [begin, end) of the slices of process p's ranks: contiguous, as the slices are.
  Shard Range(int p, std::span<const int64_t> counts, std::span<const int64_t> offsets) const {
    const int last = first_[p + 1] - 1;
    return Shard{offsets[first_[p]], offsets[last] + counts[last]};
  }

  absl::Status DoReduceScatter(std::span<void* const> buffers, std::span<const int64_t> counts,
                               std::span<const int64_t> offsets, DType dtype,
                               std::span<Stream* const> streams) override {
    std::lock_guard<std::mutex> lock(mu_);
    CallHeader header;
    header.kind = static_cast<uint32_t>(CallKind::kReduceScatter);
    header.dtype = static_cast<uint32_t>(dtype);
    header.counts_hash = HashCounts(counts);
    if (absl::Status s = Begin("ReduceScatter", streams, header); !s.ok()) return s;
    const int local = local_size();
    const Shard mine = Range(me_, counts, offsets);
    // Process q gets every rank's copy of the slices q's ranks own.
    std::vector<ByteVector> sends(processes_), recvs(processes_);
    for (int q = 0; q < processes_; ++q) {
      if (q == me_) continue;
      const Shard theirs = Range(q, counts, offsets);
      const size_t bytes = static_cast<size_t>(theirs.size()) * sizeof(float);
      sends[q].resize(bytes * local);
      for (int i = 0; i < local; ++i) {
        Copy(sends[q].data() + i * bytes, At(buffers[i], theirs.begin, sizeof(float)), bytes);
      }
      recvs[q].resize(static_cast<size_t>(mine.size()) * sizeof(float) * Local(q));
    }
    if (absl::Status s = Swap(sends, recvs); !s.ok()) return s;
    // Sums first, writes after: a local rank's slice is another local rank's term.
    std::vector<float> sums(mine.size());
    std::vector<float> terms(size());
    for (int i = 0; i < local; ++i) {
      const int owner = first_rank() + i;
      for (int64_t j = offsets[owner]; j < offsets[owner] + counts[owner]; ++j) {
        int g = 0;
        for (int p = 0; p < processes_; ++p) {
          for (int h = 0; h < Local(p); ++h, ++g) {
            const void* from =
                p == me_ ? static_cast<const void*>(At(buffers[h], j, sizeof(float)))
                         : recvs[p].data() + (h * mine.size() + (j - mine.begin)) * sizeof(float);
            Copy(&terms[g], from, sizeof(float));
          }
        }
        sums[j - mine.begin] = ReduceTerms(terms.data(), terms.size(), ReduceOp::kSum);
      }
    }
    for (int i = 0; i < local; ++i) {
      const int owner = first_rank() + i;
      Copy(At(buffers[i], offsets[owner], sizeof(float)),
           sums.data() + (offsets[owner] - mine.begin), counts[owner] * sizeof(float));
    }
    return absl::OkStatus();
  }

  absl::Status DoAllGather(std::span<void* const> buffers, std::span<const int64_t> counts,
                           std::span<const int64_t> offsets, DType dtype,
                           std::span<Stream* const> streams) override {
    std::lock_guard<std::mutex> lock(mu_);
    CallHeader header;
    header.kind = static_cast<uint32_t>(CallKind::kAllGather);
    header.dtype = static_cast<uint32_t>(dtype);
    header.counts_hash = HashCounts(counts);
    if (absl::Status s = Begin("AllGather", streams, header); !s.ok()) return s;
    const size_t element = DTypeSize(dtype);
    const int local = local_size();
    // This process's ranks' own slices, back to back: what every other process receives.
    const Shard mine = Range(me_, counts, offsets);
    ByteVector own(static_cast<size_t>(mine.size()) * element);
    for (int i = 0; i < local; ++i) {
      const int owner = first_rank() + i;
      Copy(own.data() + (offsets[owner] - mine.begin) * element,
           At(buffers[i], offsets[owner], element), counts[owner] * element);
    }
    std::vector<ByteVector> sends(processes_), recvs(processes_);
    for (int q = 0; q < processes_; ++q) {
      if (q == me_) continue;
      sends[q] = own;
      recvs[q].resize(static_cast<size_t>(Range(q, counts, offsets).size()) * element);
    }
    if (absl::Status s = Swap(sends, recvs); !s.ok()) return s;
    for (int i = 0; i < local; ++i) {
      for (int q = 0; q < processes_; ++q) {
        const ByteVector& from = q == me_ ? own : recvs[q];
        if (!from.empty()) {
          Copy(At(buffers[i], Range(q, counts, offsets).begin, element), from.data(), from.size());
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status DoBroadcast(std::span<void* const> buffers, int64_t count, DType dtype, int root,
                           std::span<Stream* const> streams) override {
    std::lock_guard<std::mutex> lock(mu_);
    CallHeader header;
    header.kind = static_cast<uint32_t>(CallKind::kBroadcast);
    header.dtype = static_cast<uint32_t>(dtype);
    header.root = root;
    header.count = count;
    if (absl::Status s = Begin("Broadcast", streams, header); !s.ok()) return s;
    const size_t bytes = static_cast<size_t>(count) * DTypeSize(dtype);
    int owner = 0;
    while (first_[owner + 1] <= root) ++owner;
    std::vector<ByteVector> sends(processes_), recvs(processes_);
    ByteVector value;
    if (owner == me_) {
      const char* from = static_cast<const char*>(buffers[root - first_rank()]);
      value.assign(reinterpret_cast<const std::byte*>(from),
                   reinterpret_cast<const std::byte*>(from + bytes));
      for (int q = 0; q < processes_; ++q) {
        if (q != me_) sends[q] = value;
      }
    } else {
      recvs[owner].resize(bytes);
    }
    if (absl::Status s = Swap(sends, recvs); !s.ok()) return s;
    const ByteVector& from = owner == me_ ? value : recvs[owner];
    for (int i = 0; i < local_size(); ++i) {
      // The root's own buffer may appear again for another local rank: copying onto itself is
      // harmless from the staging copy.
      Copy(buffers[i], from.data(), bytes);
    }
    return absl::OkStatus();
  }

  const std::shared_ptr<ProcessGroup> group_;
  const std::vector<int> first_;
  const int me_;
  const int processes_;
  // Held for a whole call, whose rounds must not interleave with another call's.
  std::mutex mu_;
  uint64_t sequence_ = 0;  // calls exchanged so far
  std::string what_;       // the call in progress, for errors
};

}  // namespace

std::unique_ptr<Collective> CreateProcessHostCollective(std::shared_ptr<ProcessGroup> group,
                                                        std::vector<int> first) {
  return std::make_unique<ProcessHostCollective>(std::move(group), std::move(first));
}

}  // namespace losshead::kernels
