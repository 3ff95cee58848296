#include "losshead/client/status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace losshead::client {

absl::Status FromGrpcStatus(const grpc::Status& status, bool cancelled_here) {
  if (status.ok()) return absl::OkStatus();
  if (status.error_code() == grpc::StatusCode::CANCELLED && !cancelled_here) {
    return absl::UnavailableError(
        absl::StrCat("the server ended the call without answering (it may be shutting down): ",
                     "CANCELLED: ", status.error_message()));
  }
  return FromCodeAndMessage(static_cast<int>(status.error_code()), status.error_message());
}

absl::Status FromCodeAndMessage(int code, const std::string& message) {
  // Codes outside the known range would otherwise build an absl::Status that claims OK-ness
  // or an unnamed code; the server sending one is itself an error.
  if (code <= 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::UnknownError(message.empty() ? "unknown status code" : message);
  }
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

}  // namespace losshead::client
