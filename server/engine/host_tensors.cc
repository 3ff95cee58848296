#include "server/engine/host_tensors.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "losshead/kernels/dtype_convert.h"

namespace losshead::server {
namespace {

void ConvertTensor(kernels::DType from, const char* src, kernels::DType to, char* dst,
                   size_t count) {
  if (from == to) {
    std::memcpy(dst, src, count * kernels::DTypeSize(from));
    return;
  }
  std::vector<float> block(std::min(count, kConvertBlock));
  for (size_t i = 0; i < count; i += kConvertBlock) {
    const size_t n = std::min(kConvertBlock, count - i);
    kernels::ToFloat(from, src + i * kernels::DTypeSize(from), block.data(), n);
    kernels::FromFloat(to, block.data(), dst + i * kernels::DTypeSize(to), n);
  }
}

}  // namespace

std::string ConvertOnHost(kernels::DType from, absl::string_view src, kernels::DType to) {
  const size_t count = src.size() / kernels::DTypeSize(from);
  std::string out(count * kernels::DTypeSize(to), '\0');
  ConvertTensor(from, src.data(), to, out.data(), count);
  return out;
}

absl::Status AsResourceExhausted(const absl::Status& status, absl::string_view what) {
  if (status.ok()) return status;
  return absl::ResourceExhaustedError(
      absl::StrCat("cannot allocate ", what, ": ", status.message()));
}

}  // namespace losshead::server
