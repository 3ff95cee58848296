#include "losshead/v1/wire_dtype.h"

namespace losshead::v1 {

size_t WireDTypeSize(DType dtype) {
  switch (dtype) {
    case DTYPE_BF16:
    case DTYPE_FP16:
      return 2;
    case DTYPE_FP32:
    case DTYPE_INT32:
      return 4;
    case DTYPE_INT64:
      return 8;
    default:
      return 0;
  }
}

}  // namespace losshead::v1
