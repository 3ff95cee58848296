// The project's status macros: early return of an error absl::Status or StatusOr. Header-only and
// dependent on absl alone, so that kernels/, server/ and client/ share one definition; the
// conversion to grpc::Status belongs to the server's edge (server/rpc/status_util.h).
#ifndef LOSSHEAD_COMMON_STATUS_MACROS_H_
#define LOSSHEAD_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"

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

#endif  // LOSSHEAD_COMMON_STATUS_MACROS_H_
