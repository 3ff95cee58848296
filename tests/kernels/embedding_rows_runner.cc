#include "tests/kernels/embedding_rows_runner.h"

#include <memory>

#include "common/status_macros.h"
#include "losshead/kernels/dtype_convert.h"

namespace losshead::kernels::testing {
namespace {

absl::StatusOr<DeviceBuffer> Upload(Backend& backend, const void* host, size_t bytes,
                                    Stream& stream) {
  LOSSHEAD_ASSIGN_OR_RETURN(DeviceBuffer buffer, backend.Allocate(bytes));
  LOSSHEAD_RETURN_IF_ERROR(backend.CopyToDevice(buffer.data(), host, bytes, stream));
  return buffer;
}

}  // namespace

absl::StatusOr<std::string> RunGatherRows(Backend& backend, DType dtype, const std::string& table,
                                          int64_t rows, int64_t d,
                                          const std::vector<int64_t>& ids) {
  LOSSHEAD_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, backend.CreateStream());
  LOSSHEAD_ASSIGN_OR_RETURN(DeviceBuffer w, Upload(backend, table.data(), table.size(), *stream));
  LOSSHEAD_ASSIGN_OR_RETURN(DeviceBuffer id,
                            Upload(backend, ids.data(), ids.size() * sizeof(int64_t), *stream));
  const size_t out_bytes = ids.size() * d * DTypeSize(dtype);
  LOSSHEAD_ASSIGN_OR_RETURN(DeviceBuffer out, backend.Allocate(out_bytes));
  LOSSHEAD_RETURN_IF_ERROR(backend.GatherRows(dtype, w.data(), rows, d, id.as<int64_t>(),
                                              static_cast<int64_t>(ids.size()), out.data(),
                                              *stream));
  std::string host(out_bytes, '\0');
  LOSSHEAD_RETURN_IF_ERROR(backend.CopyToHost(host.data(), out.data(), out_bytes, *stream));
  LOSSHEAD_RETURN_IF_ERROR(stream->Synchronize());
  return host;
}

absl::StatusOr<std::vector<float>> RunIndexAddRows(Backend& backend, std::vector<float> grad,
                                                   int64_t rows, int64_t d,
                                                   const std::vector<float>& values,
                                                   const std::vector<int64_t>& ids) {
  LOSSHEAD_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, backend.CreateStream());
  LOSSHEAD_ASSIGN_OR_RETURN(DeviceBuffer g,
                            Upload(backend, grad.data(), grad.size() * sizeof(float), *stream));
  LOSSHEAD_ASSIGN_OR_RETURN(DeviceBuffer v,
                            Upload(backend, values.data(), values.size() * sizeof(float), *stream));
  LOSSHEAD_ASSIGN_OR_RETURN(DeviceBuffer id,
                            Upload(backend, ids.data(), ids.size() * sizeof(int64_t), *stream));
  LOSSHEAD_RETURN_IF_ERROR(backend.IndexAddRows(v.as<float>(), id.as<int64_t>(),
                                                static_cast<int64_t>(ids.size()), d, g.as<float>(),
                                                rows, *stream));
  LOSSHEAD_RETURN_IF_ERROR(
      backend.CopyToHost(grad.data(), g.data(), grad.size() * sizeof(float), *stream));
  LOSSHEAD_RETURN_IF_ERROR(stream->Synchronize());
  return grad;
}

}  // namespace losshead::kernels::testing
