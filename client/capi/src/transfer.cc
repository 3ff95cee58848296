// Weights, gradients and embedding rows between the server and the caller's buffers.
#include <cstring>
#include <optional>
#include <span>

#include "absl/strings/str_cat.h"
#include "internal.h"

namespace losshead::capi {
namespace {

std::span<std::byte> Out(void* data, size_t capacity) {
  return {static_cast<std::byte*>(data), data == nullptr ? 0 : capacity};
}

}  // namespace
}  // namespace losshead::capi

extern "C" {

int lh_push_weights(lh_client* client, const char* head, int dtype, const void* data, size_t bytes,
                    int add, int has_expected_version, uint64_t expected_version,
                    uint64_t* new_version, lh_status* status) {
  return losshead::capi::Guarded(status, [&]() -> absl::Status {
    if (client == nullptr) return absl::InvalidArgumentError("null client");
    losshead::client::PushRequest request;
    request.head = head == nullptr ? "" : head;
    request.dtype = static_cast<losshead::v1::DType>(dtype);
    request.data = {static_cast<const std::byte*>(data), data == nullptr ? 0 : bytes};
    request.mode = add != 0 ? losshead::v1::PUSH_MODE_ADD : losshead::v1::PUSH_MODE_REPLACE;
    if (has_expected_version != 0) request.expected_weights_version = expected_version;
    auto version = client->client->PushWeights(request);
    if (!version.ok()) return version.status();
    if (new_version != nullptr) *new_version = *version;
    return absl::OkStatus();
  });
}

int lh_pull_gradient(lh_client* client, const char* head, int dtype, int reset, void* out,
                     size_t capacity, lh_gradient_summary* summary, lh_status* status) {
  return losshead::capi::Guarded(status, [&]() -> absl::Status {
    if (client == nullptr) return absl::InvalidArgumentError("null client");
    auto pulled = client->client->PullGradientInto(head == nullptr ? "" : head,
                                                   static_cast<losshead::v1::DType>(dtype),
                                                   reset != 0, losshead::capi::Out(out, capacity));
    if (!pulled.ok()) return pulled.status();
    if (summary != nullptr) {
      *summary = lh_gradient_summary{
          .vocab_size = pulled->vocab_size(),
          .hidden_size = pulled->hidden_size(),
          .dtype = pulled->dtype(),
          .token_count = pulled->token_count(),
          .microbatch_count = pulled->microbatch_count(),
          .min_weights_version = pulled->min_weights_version(),
          .max_weights_version = pulled->max_weights_version(),
          .total_bytes = pulled->total_bytes(),
          .was_reset = pulled->was_reset() ? 1 : 0,
      };
    }
    return absl::OkStatus();
  });
}

int lh_download_weights(lh_client* client, const char* head, int dtype, void* out, size_t capacity,
                        lh_weights_info* info, lh_status* status) {
  return losshead::capi::Guarded(status, [&]() -> absl::Status {
    if (client == nullptr) return absl::InvalidArgumentError("null client");
    auto weights = client->client->DownloadWeightsInto(head == nullptr ? "" : head,
                                                       static_cast<losshead::v1::DType>(dtype),
                                                       losshead::capi::Out(out, capacity));
    if (!weights.ok()) return weights.status();
    if (info != nullptr) {
      *info = lh_weights_info{.vocab_size = weights->vocab_size,
                              .hidden_size = weights->hidden_size,
                              .dtype = weights->dtype,
                              .weights_version = weights->weights_version};
    }
    return absl::OkStatus();
  });
}

int lh_embedding_rows(lh_client* client, const char* head, const int64_t* ids, size_t num_ids,
                      int dtype, int has_expected_version, uint64_t expected_version, void* out,
                      size_t capacity, lh_embedding_rows_info* info, lh_status* status) {
  return losshead::capi::Guarded(status, [&]() -> absl::Status {
    if (client == nullptr) return absl::InvalidArgumentError("null client");
    if (ids == nullptr || num_ids == 0) {
      return absl::InvalidArgumentError(absl::StrCat("EmbeddingRows needs at least one id (ids ",
                                                     ids == nullptr ? "null" : "given",
                                                     ", num_ids ", num_ids, ")"));
    }
    auto rows = client->client->EmbeddingRows(
        head == nullptr ? "" : head, std::span<const int64_t>(ids, num_ids),
        static_cast<losshead::v1::DType>(dtype),
        has_expected_version != 0 ? std::optional<uint64_t>(expected_version) : std::nullopt);
    if (!rows.ok()) return rows.status();
    // The shape first, also for rows that do not fit: a caller that sized `out` from a stale
    // hidden size learns the right one.
    if (info != nullptr) {
      *info = lh_embedding_rows_info{.num_rows = rows->num_rows,
                                     .hidden_size = rows->hidden_size,
                                     .dtype = rows->dtype,
                                     .weights_version = rows->weights_version};
    }
    const size_t room = out == nullptr ? 0 : capacity;
    if (rows->data.size() > room) {
      return absl::FailedPreconditionError(
          absl::StrCat("the ", rows->num_rows, " rows (", rows->data.size(),
                       " bytes) do not fit the buffer of ", room, " bytes"));
    }
    if (!rows->data.empty()) std::memcpy(out, rows->data.data(), rows->data.size());
    return absl::OkStatus();
  });
}

}  // extern "C"
