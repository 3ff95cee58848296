// What the files of Head's implementation share (head.cc, step_pipeline.cc, gradient_window.cc,
// optimizer_apply.cc, head_checkpoint.cc): host tensor conversion, the allocation error and the
// byte offsets of a replica's rows. Only those files include it.
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
#include "server/engine/replica_group.h"

namespace losshead::server {

namespace head_internal {

// Host conversions go through fp32 in blocks so that a 1 GiB tensor needs no 2 GiB temporary.
inline constexpr size_t kConvertBlock = size_t{1} << 20;

// `src` (elements of `from`) converted to `to` on the host, block by block; a copy when equal.
std::string Convert(kernels::DType from, absl::string_view src, kernels::DType to);

// An allocation failure as RESOURCE_EXHAUSTED naming `what`; OK stays OK.
absl::Status AsResourceExhausted(const absl::Status& status, absl::string_view what);

// `replica`'s rows in a V x D tensor whose elements take `element_bytes`: where they start and
// how many bytes they take.
inline size_t RowByteOffset(const ReplicaGroup& group, const Replica& replica,
                            size_t element_bytes) {
  return static_cast<size_t>(group.RowOffset(replica)) * element_bytes;
}
// Where they start in the replica's own W or dW (0 for a shard, which holds only its rows).
inline size_t DeviceRowByteOffset(const ReplicaGroup& group, const Replica& replica,
                                  size_t element_bytes) {
  return static_cast<size_t>(group.DeviceRowOffset(replica)) * element_bytes;
}
inline size_t RowBytes(const ReplicaGroup& group, const Replica& replica, size_t element_bytes) {
  return static_cast<size_t>(group.RowElements(replica)) * element_bytes;
}

}  // namespace head_internal
}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_HEAD_INTERNAL_H_
