// Conversions between the wire contract (losshead.v1) and the kernel API, with their validation.
#ifndef LOSSHEAD_SERVER_ENGINE_PROTO_CONVERT_H_
#define LOSSHEAD_SERVER_ENGINE_PROTO_CONVERT_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "losshead/kernels/problem.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::server {

// BF16 | FP16 | FP32 -> kernel dtype; anything else is INVALID_ARGUMENT naming `field`.
absl::StatusOr<kernels::DType> FloatDType(v1::DType dtype, absl::string_view field);
v1::DType ToProto(kernels::DType dtype);

// A head's matmul_precision for its weight dtype (UNSPECIFIED: highest): INVALID_ARGUMENT for a
// value out of the enum, or HIGH or MEDIUM on a 16-bit head.
absl::StatusOr<kernels::MatmulPrecision> ToKernel(v1::MatmulPrecision precision,
                                                  kernels::DType dtype);
v1::MatmulPrecision ToProto(kernels::MatmulPrecision precision);

// Checks the fields that are set: INVALID_ARGUMENT names the offending one.
absl::Status ValidateLossOptions(const v1::LossOptions& options);

// Resolves request -> head default -> built-in, field by field. `step` may be null. The result is
// validated (INVALID_ARGUMENT).
absl::StatusOr<kernels::LossOptions> ResolveLossOptions(const v1::LossOptions& request,
                                                        const v1::LossOptions& head_default,
                                                        const v1::StepOptions* step);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_PROTO_CONVERT_H_
