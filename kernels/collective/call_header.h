// What every process of a group says about a collective call before any of its data moves: the
// call, its sequence number and its arguments. Processes that disagree learn it at once
// (FAILED_PRECONDITION on every one of them, nothing touched) instead of exchanging bytes that
// mean different things; and since the headers themselves were exchanged whole, the connections
// stay in step and the group stays usable.
#ifndef LOSSHEAD_KERNELS_COLLECTIVE_CALL_HEADER_H_
#define LOSSHEAD_KERNELS_COLLECTIVE_CALL_HEADER_H_

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/process_group.h"

namespace losshead::kernels {

enum class CallKind : uint32_t { kAllReduce = 1, kReduceScatter, kAllGather, kBroadcast, kCreate };

struct CallHeader {
  uint64_t sequence = 0;  // calls this collective has exchanged before this one
  uint32_t kind = 0;      // CallKind
  uint32_t dtype = 0;
  uint32_t op = 0;  // ReduceOp for AllReduce
  int32_t root = -1;
  int64_t count = 0;         // AllReduce / Broadcast
  uint64_t counts_hash = 0;  // ReduceScatter / AllGather: FNV-1a over the counts
};

uint64_t HashCounts(std::span<const int64_t> counts);

// Exchanges `mine` with every process of `group` and compares: OK when all agree;
// FAILED_PRECONDITION naming the first process that differs and both calls; the group's error
// (UNAVAILABLE) when the exchange fails.
absl::Status AgreeOnCall(ProcessGroup& group, absl::string_view what, const CallHeader& mine);

std::string DescribeCall(const CallHeader& header);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_COLLECTIVE_CALL_HEADER_H_
