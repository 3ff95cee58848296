#include "server/status_util.h"

#include "absl/strings/ascii.h"

namespace losshead::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

std::string CodeName(int code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

std::string ReasonName(int code) { return absl::AsciiStrToLower(CodeName(code)); }

}  // namespace losshead::server
