// Weights, gradients and embedding rows between the server and the caller's buffers.
#include <cstring>
#include <optional>
#include <span>
#include <string>

#include "absl/strings/str_cat.h"
#include "internal.h"
#include "losshead/v1/wire_dtype.h"

namespace losshead::capi {
namespace {

std::span<std::byte> Out(void* data, size_t capacity) {
  return {static_cast<std::byte*>(data), data == nullptr ? 0 : capacity};
}

// A bias buffer's pointer and capacity agree: null with a capacity is a caller's mistake that
// would otherwise read as "no buffer" and put b after W.
absl::Status CheckBiasBuffer(const void* bias, size_t bytes, const char* name) {
  if (bias == nullptr && bytes > 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is null with ", bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status Push(lh_client* client, const char* head, int dtype, const void* data, size_t bytes,
                  const void* bias, size_t bias_bytes, int add, int has_expected_version,
                  uint64_t expected_version, uint64_t* new_version) {
  if (client == nullptr) return absl::InvalidArgumentError("null client");
  losshead::client::PushRequest request;
  request.head = head == nullptr ? "" : head;
  request.dtype = static_cast<losshead::v1::DType>(dtype);
  request.data = {static_cast<const std::byte*>(data), data == nullptr ? 0 : bytes};
  request.bias = {static_cast<const std::byte*>(bias), bias == nullptr ? 0 : bias_bytes};
  request.mode = add != 0 ? losshead::v1::PUSH_MODE_ADD : losshead::v1::PUSH_MODE_REPLACE;
  if (has_expected_version != 0) request.expected_weights_version = expected_version;
  auto version = client->client->PushWeights(request);
  if (!version.ok()) return version.status();
  if (new_version != nullptr) *new_version = *version;
  return absl::OkStatus();
}

// `bias_out`: b's own buffer, or none (b then follows W in `out`).
absl::Status Pull(lh_client* client, const char* head, int dtype, int reset, void* out,
                  size_t capacity, std::optional<std::span<std::byte>> bias_out,
                  lh_gradient_summary* summary, uint64_t* bias_bytes) {
  if (client == nullptr) return absl::InvalidArgumentError("null client");
  const std::string name = head == nullptr ? "" : head;
  const auto type = static_cast<losshead::v1::DType>(dtype);
  auto pulled =
      bias_out.has_value()
          ? client->client->PullGradientInto(name, type, reset != 0, Out(out, capacity), *bias_out)
          : client->client->PullGradientInto(name, type, reset != 0, Out(out, capacity));
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
  if (bias_bytes != nullptr) {
    *bias_bytes = pulled->bias() ? static_cast<uint64_t>(pulled->vocab_size()) *
                                       losshead::v1::WireDTypeSize(pulled->dtype())
                                 : 0;
  }
  return absl::OkStatus();
}

absl::Status Download(lh_client* client, const char* head, int dtype, void* out, size_t capacity,
                      std::optional<std::span<std::byte>> bias_out, lh_weights_info* info,
                      uint64_t* bias_bytes) {
  if (client == nullptr) return absl::InvalidArgumentError("null client");
  const std::string name = head == nullptr ? "" : head;
  const auto type = static_cast<losshead::v1::DType>(dtype);
  auto weights =
      bias_out.has_value()
          ? client->client->DownloadWeightsInto(name, type, Out(out, capacity), *bias_out)
          : client->client->DownloadWeightsInto(name, type, Out(out, capacity));
  if (!weights.ok()) return weights.status();
  if (info != nullptr) {
    *info = lh_weights_info{.vocab_size = weights->vocab_size,
                            .hidden_size = weights->hidden_size,
                            .dtype = weights->dtype,
                            .weights_version = weights->weights_version};
  }
  if (bias_bytes != nullptr) {
    *bias_bytes = weights->has_bias ? static_cast<uint64_t>(weights->vocab_size) *
                                          losshead::v1::WireDTypeSize(weights->dtype)
                                    : 0;
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace losshead::capi

extern "C" {

int lh_push_weights(lh_client* client, const char* head, int dtype, const void* data, size_t bytes,
                    int add, int has_expected_version, uint64_t expected_version,
                    uint64_t* new_version, lh_status* status) {
  return losshead::capi::Guarded(status, [&] {
    return losshead::capi::Push(client, head, dtype, data, bytes, nullptr, 0, add,
                                has_expected_version, expected_version, new_version);
  });
}

int lh_pull_gradient(lh_client* client, const char* head, int dtype, int reset, void* out,
                     size_t capacity, lh_gradient_summary* summary, lh_status* status) {
  return losshead::capi::Guarded(status, [&] {
    return losshead::capi::Pull(client, head, dtype, reset, out, capacity, std::nullopt, summary,
                                nullptr);
  });
}

int lh_download_weights(lh_client* client, const char* head, int dtype, void* out, size_t capacity,
                        lh_weights_info* info, lh_status* status) {
  return losshead::capi::Guarded(status, [&] {
    return losshead::capi::Download(client, head, dtype, out, capacity, std::nullopt, info,
                                    nullptr);
  });
}

int lh_push_weights_bias(lh_client* client, const char* head, int dtype, const void* data,
                         size_t bytes, const void* bias, size_t bias_bytes, int add,
                         int has_expected_version, uint64_t expected_version, uint64_t* new_version,
                         lh_status* status) {
  return losshead::capi::Guarded(status, [&]() -> absl::Status {
    if (absl::Status ok = losshead::capi::CheckBiasBuffer(bias, bias_bytes, "bias"); !ok.ok()) {
      return ok;
    }
    return losshead::capi::Push(client, head, dtype, data, bytes, bias, bias_bytes, add,
                                has_expected_version, expected_version, new_version);
  });
}

int lh_pull_gradient_bias(lh_client* client, const char* head, int dtype, int reset, void* out,
                          size_t capacity, void* bias_out, size_t bias_capacity,
                          lh_gradient_summary* summary, uint64_t* bias_bytes, lh_status* status) {
  return losshead::capi::Guarded(status, [&]() -> absl::Status {
    if (absl::Status ok = losshead::capi::CheckBiasBuffer(bias_out, bias_capacity, "bias_out");
        !ok.ok()) {
      return ok;
    }
    return losshead::capi::Pull(client, head, dtype, reset, out, capacity,
                                losshead::capi::Out(bias_out, bias_capacity), summary, bias_bytes);
  });
}

int lh_download_weights_bias(lh_client* client, const char* head, int dtype, void* out,
                             size_t capacity, void* bias_out, size_t bias_capacity,
                             lh_weights_info* info, uint64_t* bias_bytes, lh_status* status) {
  return losshead::capi::Guarded(status, [&]() -> absl::Status {
    if (absl::Status ok = losshead::capi::CheckBiasBuffer(bias_out, bias_capacity, "bias_out");
        !ok.ok()) {
      return ok;
    }
    return losshead::capi::Download(client, head, dtype, out, capacity,
                                    losshead::capi::Out(bias_out, bias_capacity), info, bias_bytes);
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
