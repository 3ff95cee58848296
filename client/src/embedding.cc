// The Client's calls for a head tied to its model's input embedding: its rows (EmbeddingRows, a
// server-streamed read reassembled here) and their gradient (an EMBEDDING_GRAD micro-batch on a
// Step stream, with Step's key and retries).
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "losshead/client/client.h"
#include "losshead/client/status.h"

namespace losshead::client {

absl::StatusOr<FetchedRows> Client::EmbeddingRows(
    const std::string& head, std::span<const int64_t> ids, v1::DType dtype,
    std::optional<uint64_t> expected_weights_version) {
  if (ids.empty()) return absl::InvalidArgumentError("EmbeddingRows needs at least one id");
  const size_t bytes = ids.size() * sizeof(int64_t);
  if (bytes + 1024 > options_.max_message_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(ids.size(), " ids (", bytes, " bytes) do not fit one message of ",
                     options_.max_message_bytes, " bytes: split them over several calls"));
  }
  v1::EmbeddingRowsRequest request;
  request.set_head(head);
  request.set_id_dtype(v1::DTYPE_INT64);
  request.set_ids(reinterpret_cast<const char*>(ids.data()), bytes);
  request.set_dtype(dtype);
  if (expected_weights_version.has_value()) {
    request.set_expected_weights_version(*expected_weights_version);
  }
  absl::StatusOr<FetchedRows> result = absl::UnknownError("not attempted");
  const absl::Status status = RunWithRetry([&] {
    result = EmbeddingRowsOnce(request);
    return result.status();
  });
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<FetchedRows> Client::EmbeddingRowsOnce(const v1::EmbeddingRowsRequest& request) {
  auto context = NewContext(options_.deadline);
  std::unique_ptr<grpc::ClientReader<v1::EmbeddingRowsChunk>> reader(
      stub_->EmbeddingRows(context.get(), request));
  FetchedRows rows;
  absl::Status framing;
  uint64_t total = 0;
  bool first = true;
  v1::EmbeddingRowsChunk chunk;
  while (reader->Read(&chunk)) {
    if (!framing.ok()) continue;  // drain so that Finish() can return
    if (first) {
      first = false;
      rows.num_rows = chunk.num_rows();
      rows.hidden_size = chunk.hidden_size();
      rows.dtype = chunk.dtype();
      rows.weights_version = chunk.weights_version();
      total = chunk.total_bytes();
      rows.data.resize(total);
    }
    const std::string& data = chunk.data();
    if (chunk.offset() > total || data.size() > total - chunk.offset()) {
      framing = absl::InternalError(absl::StrCat("EmbeddingRows chunk at offset ", chunk.offset(),
                                                 " runs past the announced ", total, " bytes"));
      continue;
    }
    std::memcpy(rows.data.data() + chunk.offset(), data.data(), data.size());
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (!framing.ok()) return framing;
  if (first) return absl::InternalError("EmbeddingRows answered no chunk");
  return rows;
}

absl::StatusOr<StepResult> Client::EmbeddingGrad(const std::string& head,
                                                 const std::string& client_id, uint64_t sequence,
                                                 std::span<const int64_t> ids, v1::DType grad_dtype,
                                                 std::span<const std::byte> grad) {
  Microbatch mb;
  mb.kind = v1::STEP_KIND_EMBEDDING_GRAD;
  mb.head = head;
  mb.client_id = client_id;
  mb.sequence = sequence;
  mb.num_tokens = static_cast<int64_t>(ids.size());
  mb.hidden_dtype = grad_dtype;
  mb.hidden = grad;
  mb.target_dtype = v1::DTYPE_INT64;
  mb.targets = std::as_bytes(ids);
  return Step(mb);
}

}  // namespace losshead::client
