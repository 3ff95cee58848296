// CreateProcessCollective: the processes agree on what they hold (the kind of their backends and
// how many), then the implementation for that kind is built over the group.
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/collective/backend_kinds.h"
#include "kernels/collective/process_host_collective.h"
#include "losshead/kernels/process_group.h"
#ifdef LOSSHEAD_HAVE_NCCL
#include "kernels/collective/nccl_collective.h"
#endif

namespace losshead::kernels {
namespace {

// What each process says about its backends. kRefused: it refused its own backends (and returns
// that error); the others learn it instead of waiting for it.
enum class Kind : uint32_t { kRefused = 0, kCpu = 1, kCuda = 2 };

struct Holding {
  uint32_t kind = 0;
  uint32_t ranks = 0;
};

absl::string_view BackendKindName(uint32_t kind) {
  switch (static_cast<Kind>(kind)) {
    case Kind::kCpu:
      return "cpu";
    case Kind::kCuda:
      return "cuda";
    default:
      return "refused";
  }
}

// The local half of the checks: what CreateCollective refuses in one process.
absl::StatusOr<Kind> LocalKind(std::span<Backend* const> backends) {
  absl::StatusOr<BackendKinds> kinds = CountBackendKinds("CreateProcessCollective", backends);
  if (!kinds.ok()) return kinds.status();
  const int cpu = kinds->cpu;
  const int cuda = kinds->cuda;
  if (cpu > 0 && cuda > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateProcessCollective: ", cpu, " cpu and ", cuda, " cuda backends"));
  }
  if (cpu > 0) return Kind::kCpu;
  // NCCL takes one rank per device; within a process, ranks sharing a device are
  // CreateCollective's staged case, which does not span processes.
  std::set<int> seen;
  std::vector<int> devices;
  for (size_t r = 0; r < backends.size(); ++r) {
    const int device = backends[r]->device_ordinal();
    if (device < 0 || !seen.insert(device).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("CreateProcessCollective: cuda backend of rank ", r, " (",
                       backends[r]->device_description(), ") names no device or one named before"));
    }
    devices.push_back(device);
  }
#ifdef LOSSHEAD_HAVE_NCCL
  if (absl::Status s = CheckNcclDevices(devices); !s.ok()) return s;
#endif
  return Kind::kCuda;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Collective>> CreateProcessCollective(
    std::shared_ptr<ProcessGroup> group, std::span<Backend* const> backends) {
  if (group == nullptr) return absl::InvalidArgumentError("CreateProcessCollective: no group");
  const absl::StatusOr<Kind> kind = LocalKind(backends);
  Holding mine;
  mine.kind = static_cast<uint32_t>(kind.ok() ? *kind : Kind::kRefused);
  mine.ranks = static_cast<uint32_t>(backends.size());
  std::byte bytes[sizeof(Holding)];
  std::memcpy(bytes, &mine, sizeof(mine));
  absl::StatusOr<std::vector<std::vector<std::byte>>> all =
      group->AllGather("CreateProcessCollective", bytes);
  if (!all.ok()) return all.status();
  if (!kind.ok()) return kind.status();
  std::vector<int> first = {0};
  for (int p = 0; p < group->size(); ++p) {
    Holding theirs;
    std::memcpy(&theirs, (*all)[p].data(), sizeof(theirs));
    if (theirs.kind != mine.kind) {
      return absl::FailedPreconditionError(
          absl::StrCat("CreateProcessCollective: process ", p, " holds ",
                       BackendKindName(theirs.kind), " backends, process ", group->rank(), " ",
                       BackendKindName(mine.kind), ": one collective spans backends of one kind"));
    }
    first.push_back(first.back() + static_cast<int>(theirs.ranks));
  }
  if (*kind == Kind::kCpu) return CreateProcessHostCollective(std::move(group), std::move(first));
#ifdef LOSSHEAD_HAVE_NCCL
  std::vector<int> devices;
  for (Backend* backend : backends) devices.push_back(backend->device_ordinal());
  return CreateProcessNcclCollective(std::move(group), devices, std::move(first));
#else
  return absl::UnimplementedError(
      "CreateProcessCollective: this build of losshead has no NCCL, so CUDA backends have no "
      "collective");
#endif
}

}  // namespace losshead::kernels
