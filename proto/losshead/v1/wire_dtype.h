// Facts about the contract's tensor encoding that both sides of the wire rely on.
#ifndef LOSSHEAD_V1_WIRE_DTYPE_H_
#define LOSSHEAD_V1_WIRE_DTYPE_H_

#include <cstddef>

#include "losshead/v1/losshead.pb.h"

namespace losshead::v1 {

// Bytes per element of a wire dtype; 0 for DTYPE_UNSPECIFIED or unknown values.
size_t WireDTypeSize(DType dtype);

}  // namespace losshead::v1

#endif  // LOSSHEAD_V1_WIRE_DTYPE_H_
