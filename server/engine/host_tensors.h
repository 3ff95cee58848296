// Host-side helpers for tensors every part of a head handles: dtype conversion on the host (in
// blocks, so that a 1 GiB tensor needs no 2 GiB temporary) and the one wording of an allocation
// failure.
#ifndef LOSSHEAD_SERVER_ENGINE_HOST_TENSORS_H_
#define LOSSHEAD_SERVER_ENGINE_HOST_TENSORS_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "losshead/kernels/backend.h"

namespace losshead::server {

// Elements converted through fp32 at a time.
inline constexpr size_t kConvertBlock = size_t{1} << 20;

// `src` (elements of `from`) converted to `to` on the host, block by block; a copy when equal.
std::string ConvertOnHost(kernels::DType from, absl::string_view src, kernels::DType to);

// An allocation failure as RESOURCE_EXHAUSTED naming `what`; OK stays OK.
absl::Status AsResourceExhausted(const absl::Status& status, absl::string_view what);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_HOST_TENSORS_H_
