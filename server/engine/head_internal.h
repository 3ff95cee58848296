// What the files of Head's implementation share (head.cc, step_pipeline.cc, gradient_window.cc,
// head_checkpoint.cc): the I/O slot, host tensor conversion and the allocation error. Only those
// files include it.
#ifndef LOSSHEAD_SERVER_ENGINE_HEAD_INTERNAL_H_
#define LOSSHEAD_SERVER_ENGINE_HEAD_INTERNAL_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/problem.h"
#include "server/engine/head.h"

namespace losshead::server {

// One micro-batch's device buffers, its staging host memory (empty where the backend needs none)
// and a stream of its own for the copies, so that they run beside another micro-batch's Run.
struct Head::IoSlot {
  std::unique_ptr<kernels::Stream> copies;
  kernels::DeviceBuffer hidden;
  kernels::DeviceBuffer targets;
  kernels::DeviceBuffer grad_hidden;
  kernels::DeviceBuffer per_token;
  kernels::DeviceBuffer scalars;
  kernels::HostBuffer staging;  // hidden + targets in, then dH + per-token losses out
};

namespace head_internal {

// Host conversions go through fp32 in blocks so that a 1 GiB tensor needs no 2 GiB temporary.
inline constexpr size_t kConvertBlock = size_t{1} << 20;

// `src` (elements of `from`) converted to `to` on the host, block by block; a copy when equal.
std::string Convert(kernels::DType from, absl::string_view src, kernels::DType to);

// An allocation failure as RESOURCE_EXHAUSTED naming `what`; OK stays OK.
absl::Status AsResourceExhausted(const absl::Status& status, absl::string_view what);

}  // namespace head_internal
}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_HEAD_INTERNAL_H_
