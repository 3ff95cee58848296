// What the files of Head's implementation share (head.cc, step_pipeline.cc, gradient_window.cc,
// optimizer_apply.cc, head_checkpoint.cc): the byte offsets of a replica's rows, and the host
// tensor helpers (host_tensors.h). Only those files include it.
#ifndef LOSSHEAD_SERVER_ENGINE_HEAD_INTERNAL_H_
#define LOSSHEAD_SERVER_ENGINE_HEAD_INTERNAL_H_

#include <cstddef>
#include <utility>

#include "absl/status/status.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/problem.h"
#include "server/engine/head.h"
#include "server/engine/host_tensors.h"
#include "server/engine/replica_group.h"

namespace losshead::server {

namespace head_internal {

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

// The bytes of this process's rows (its replicas' together, contiguous) in a V x D tensor whose
// elements take `element_bytes`: [first, second).
std::pair<size_t, size_t> OwnRowBytes(const ReplicaGroup& group, size_t element_bytes);

// Under the cut, after ReduceGradientToOwners: every owner's rows of dW to `host` (V x D fp32),
// and back from it (waits for the copies).
absl::Status ReadOwnedGrad(ReplicaGroup& group, char* host);
absl::Status WriteOwnedGrad(ReplicaGroup& group, const char* host);

}  // namespace head_internal
}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_HEAD_INTERNAL_H_
