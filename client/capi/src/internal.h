// What the C ABI's translation units share: the client handle and status reporting.
#ifndef LOSSHEAD_CLIENT_CAPI_SRC_INTERNAL_H_
#define LOSSHEAD_CLIENT_CAPI_SRC_INTERNAL_H_

#include <memory>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "losshead/capi.h"
#include "losshead/client/client.h"

struct lh_client {
  std::unique_ptr<losshead::client::Client> client;
};

struct lh_device_region {
  std::shared_ptr<const losshead::client::DeviceRegion> region;
};

namespace losshead::capi {

// Fills `out` (when not null) from `status` and returns its code.
int Report(const absl::Status& status, lh_status* out);

// Runs `body` and reports its status; a C++ exception (allocation failure) becomes a status
// here, because unwinding into a C caller (ctypes) would abort the process.
int Guarded(lh_status* out, absl::FunctionRef<absl::Status()> body);

}  // namespace losshead::capi

#endif  // LOSSHEAD_CLIENT_CAPI_SRC_INTERNAL_H_
