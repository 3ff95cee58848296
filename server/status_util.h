// The one place where absl::Status becomes grpc::Status, plus the status macros of server/.
#ifndef LOSSHEAD_SERVER_STATUS_UTIL_H_
#define LOSSHEAD_SERVER_STATUS_UTIL_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace losshead::server {

// absl and gRPC share the numeric codes, so the code carries over as is; the message too.
grpc::Status ToGrpcStatus(const absl::Status& status);

// "INVALID_ARGUMENT", "OK", ... (the label value of losshead_rpcs_total{code}).
std::string CodeName(int code);
// "invalid_argument", ... (the label value of losshead_failures_total{reason}).
std::string ReasonName(int code);

}  // namespace losshead::server

#define LOSSHEAD_STATUS_CONCAT_INNER_(a, b) a##b
#define LOSSHEAD_STATUS_CONCAT_(a, b) LOSSHEAD_STATUS_CONCAT_INNER_(a, b)

#define LOSSHEAD_RETURN_IF_ERROR(expr)                   \
  do {                                                   \
    ::absl::Status losshead_status_ = (expr);            \
    if (!losshead_status_.ok()) return losshead_status_; \
  } while (0)

#define LOSSHEAD_ASSIGN_OR_RETURN(lhs, expr) \
  LOSSHEAD_ASSIGN_OR_RETURN_IMPL_(LOSSHEAD_STATUS_CONCAT_(losshead_statusor_, __LINE__), lhs, expr)

#define LOSSHEAD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                    \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = std::move(statusor).value()

#endif  // LOSSHEAD_SERVER_STATUS_UTIL_H_
