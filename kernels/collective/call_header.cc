#include "kernels/collective/call_header.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace losshead::kernels {
namespace {

absl::string_view CallKindName(uint32_t kind) {
  switch (static_cast<CallKind>(kind)) {
    case CallKind::kAllReduce:
      return "AllReduce";
    case CallKind::kReduceScatter:
      return "ReduceScatter";
    case CallKind::kAllGather:
      return "AllGather";
    case CallKind::kBroadcast:
      return "Broadcast";
    case CallKind::kCreate:
      return "CreateProcessCollective";
  }
  return "an unknown call";
}

}  // namespace

uint64_t HashCounts(std::span<const int64_t> counts) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (int64_t c : counts) {
    for (int b = 0; b < 8; ++b) {
      hash ^= static_cast<uint64_t>(c >> (8 * b)) & 0xff;
      hash *= 0x100000001b3ull;
    }
  }
  return hash ^ counts.size();
}

std::string DescribeCall(const CallHeader& h) {
  std::string text = absl::StrCat(CallKindName(h.kind), " #", h.sequence);
  switch (static_cast<CallKind>(h.kind)) {
    case CallKind::kAllReduce:
      absl::StrAppend(&text, " (", h.count, " elements, op ", h.op, ")");
      break;
    case CallKind::kBroadcast:
      absl::StrAppend(&text, " (", h.count, " elements of dtype ", h.dtype, ", root ", h.root, ")");
      break;
    case CallKind::kReduceScatter:
    case CallKind::kAllGather:
      absl::StrAppend(&text, " (dtype ", h.dtype, ", counts hash ", h.counts_hash, ")");
      break;
    default:
      break;
  }
  return text;
}

absl::Status AgreeOnCall(ProcessGroup& group, absl::string_view what, const CallHeader& mine) {
  std::byte bytes[sizeof(CallHeader)];
  std::memcpy(bytes, &mine, sizeof(mine));
  absl::StatusOr<std::vector<std::vector<std::byte>>> all = group.AllGather(what, bytes);
  if (!all.ok()) return all.status();
  for (int p = 0; p < group.size(); ++p) {
    CallHeader theirs;
    std::memcpy(&theirs, (*all)[p].data(), sizeof(theirs));
    if (std::memcmp(&theirs, &mine, sizeof(mine)) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": process ", p, " called ", DescribeCall(theirs), " where process ",
                       group.rank(), " called ", DescribeCall(mine),
                       ": every process must make the same collective calls in the same order"));
    }
  }
  return absl::OkStatus();
}

}  // namespace losshead::kernels
