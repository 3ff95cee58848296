// device_ipc.h in a build without CUDA: no devices, every device region refused.
#include "server/rpc/device_ipc.h"

namespace losshead::server {

std::vector<IpcDevice> DescribeIpcDevices(const std::vector<int>&) { return {}; }

absl::StatusOr<std::unique_ptr<DeviceMapping>> DeviceMapping::Open(const std::vector<IpcDevice>&,
                                                                   absl::string_view, uint64_t,
                                                                   uint64_t, absl::string_view) {
  return absl::FailedPreconditionError(
      "this server was built without CUDA: it opens no device regions (register a host region)");
}

DeviceMapping::~DeviceMapping() = default;

absl::Status DeviceMapping::CopyOut(void*, uint64_t, uint64_t) const {
  return absl::FailedPreconditionError("no CUDA in this build");
}

absl::Status DeviceMapping::CopyOutPieces(void*, uint64_t, uint64_t,
                                          absl::FunctionRef<void(uint64_t)>) const {
  return absl::FailedPreconditionError("no CUDA in this build");
}

absl::Status DeviceMapping::CopyIn(uint64_t, const void*, uint64_t) const {
  return absl::FailedPreconditionError("no CUDA in this build");
}

}  // namespace losshead::server
