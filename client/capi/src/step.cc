// lh_step_many: C micro-batches to Client::StepMany and its answers back into C results.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "internal.h"
#include "losshead/client/step_stream.h"

namespace losshead::capi {
namespace {

std::span<const std::byte> Bytes(const void* data, size_t size) {
  return {static_cast<const std::byte*>(data), data == nullptr ? 0 : size};
}

// A Microbatch whose tensors are views of the caller's buffers; `mb.head` and the key are the
// only copies made.
absl::StatusOr<client::Microbatch> ToMicrobatch(const lh_microbatch& in) {
  client::Microbatch mb;
  mb.head = in.head == nullptr ? "" : in.head;
  mb.client_id = in.client_id == nullptr ? "" : in.client_id;
  mb.sequence = in.sequence;
  mb.num_tokens = in.num_tokens;
  mb.hidden_dtype = static_cast<v1::DType>(in.hidden_dtype);
  mb.hidden = Bytes(in.hidden, in.hidden_bytes);
  mb.target_dtype = static_cast<v1::DType>(in.target_dtype);
  mb.targets = Bytes(in.targets, in.targets_bytes);
  if (in.options_bytes > 0 &&
      !mb.options.ParseFromArray(in.options, static_cast<int>(in.options_bytes))) {
    return absl::InvalidArgumentError("unparsable StepOptions");
  }
  if (in.loss_options_bytes > 0 &&
      !mb.loss_options.ParseFromArray(in.loss_options, static_cast<int>(in.loss_options_bytes))) {
    return absl::InvalidArgumentError("unparsable LossOptions");
  }
  mb.grad_hidden_out =
      std::span<std::byte>(static_cast<std::byte*>(in.grad_hidden_out),
                           in.grad_hidden_out == nullptr ? 0 : in.grad_hidden_capacity);
  return mb;
}

// One token input of micro-batch `index` as a view of the caller's values: none (null, 0), or
// exactly num_tokens values. Checked here because a wrong count would make the view read past
// the caller's buffer.
absl::StatusOr<std::span<const float>> TokenInput(const float* values, size_t count,
                                                  int64_t num_tokens, absl::string_view name,
                                                  size_t index) {
  if (values == nullptr && count == 0) return std::span<const float>();
  if (values == nullptr || count == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "micro-batch ", index, ": ", name, " is ", values == nullptr ? "null" : "not null",
        " with a count of ", count, " (give both, or neither)"));
  }
  if (num_tokens < 0 || count != static_cast<uint64_t>(num_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "micro-batch ", index, ": ", count, " values of ", name, " for ", num_tokens, " tokens"));
  }
  return std::span<const float>(values, count);
}

// Version 4's part of a micro-batch into `mb`.
absl::Status AddInputs(const lh_microbatch_inputs& in, size_t index, client::Microbatch& mb) {
  if (!v1::StepKind_IsValid(in.kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro-batch ", index, ": kind ", in.kind, " is not a StepKind"));
  }
  mb.kind = static_cast<v1::StepKind>(in.kind);
  const int64_t n = mb.num_tokens;
  auto weights = TokenInput(in.token_weights, in.token_weights_count, n, "token_weights", index);
  if (!weights.ok()) return weights.status();
  auto old_logprob = TokenInput(in.old_logprob, in.old_logprob_count, n, "old_logprob", index);
  if (!old_logprob.ok()) return old_logprob.status();
  auto advantages = TokenInput(in.advantages, in.advantages_count, n, "advantages", index);
  if (!advantages.ok()) return advantages.status();
  auto ref_logprob = TokenInput(in.ref_logprob, in.ref_logprob_count, n, "ref_logprob", index);
  if (!ref_logprob.ok()) return ref_logprob.status();
  mb.token_weights = *weights;
  mb.old_logprob = *old_logprob;
  mb.advantages = *advantages;
  mb.ref_logprob = *ref_logprob;
  return absl::OkStatus();
}

// `values` into the caller's `dest` of `capacity` elements; INTERNAL when they do not fit.
template <typename T>
absl::Status CopyValues(const std::vector<T>& values, T* dest, size_t capacity,
                        absl::string_view name, uint64_t* count) {
  if (values.size() > (dest == nullptr ? 0 : capacity)) {
    return absl::InternalError(absl::StrCat(values.size(), " values of ", name,
                                            " do not fit the buffer of ",
                                            dest == nullptr ? 0 : capacity));
  }
  if (!values.empty()) std::memcpy(dest, values.data(), values.size() * sizeof(T));
  *count = values.size();
  return absl::OkStatus();
}

absl::Status ToResult(const lh_microbatch& in, const absl::StatusOr<client::StepResult>& answer,
                      lh_step_result* out) {
  if (!answer.ok()) return answer.status();
  const client::StepResult& r = *answer;
  const size_t cap = in.token_output_capacity;
  absl::Status copied = CopyValues(r.per_token_logprob, in.per_token_logprob_out, cap,
                                   "per_token_logprob", &out->per_token_logprob_count);
  if (copied.ok()) {
    copied = CopyValues(r.per_token_entropy, in.per_token_entropy_out, cap, "per_token_entropy",
                        &out->per_token_entropy_count);
  }
  if (copied.ok()) {
    copied = CopyValues(r.per_token_lse, in.per_token_lse_out, cap, "per_token_lse",
                        &out->per_token_lse_count);
  }
  if (copied.ok()) {
    copied = CopyValues(r.per_token_argmax, in.per_token_argmax_out, cap, "per_token_argmax",
                        &out->per_token_argmax_count);
  }
  if (copied.ok()) {
    copied = CopyValues(r.top_k_ids, in.top_k_ids_out, in.top_k_capacity, "top_k_ids",
                        &out->top_k_ids_count);
  }
  if (copied.ok()) {
    copied = CopyValues(r.top_k_logprobs, in.top_k_logprobs_out, in.top_k_capacity,
                        "top_k_logprobs", &out->top_k_logprobs_count);
  }
  if (!copied.ok()) return copied;
  out->has_correct_count = r.correct_count.has_value() ? 1 : 0;
  out->correct_count = r.correct_count.value_or(0);
  if (r.per_token_loss.size() > in.per_token_loss_capacity) {
    return absl::InternalError(absl::StrCat(r.per_token_loss.size(),
                                            " per-token losses do not fit the buffer of ",
                                            in.per_token_loss_capacity));
  }
  if (!r.per_token_loss.empty()) {
    std::memcpy(in.per_token_loss_out, r.per_token_loss.data(),
                r.per_token_loss.size() * sizeof(float));
  }
  out->loss = r.loss;
  out->loss_sum = r.loss_sum;
  out->token_count = r.token_count;
  out->weights_version = r.weights_version;
  out->replayed = r.replayed ? 1 : 0;
  out->forward_only = r.forward_only ? 1 : 0;
  out->grad_hidden_dtype = r.grad_hidden_dtype;
  out->grad_hidden_bytes = r.grad_hidden_bytes;
  out->per_token_loss_count = r.per_token_loss.size();
  return absl::OkStatus();
}

// Version 6's part of a micro-batch into `mb`: its tensors in a device region.
absl::Status AddDevice(const lh_device_tensors& in, size_t index, client::Microbatch& mb) {
  if (in.region == nullptr) return absl::OkStatus();
  if (!mb.hidden.empty() || !mb.targets.empty() || mb.grad_hidden_out->data() != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "micro-batch ", index, ": hidden, targets or grad_hidden_out given with a device region"));
  }
  mb.grad_hidden_out.reset();
  mb.device = client::Microbatch::DeviceTensors{.region = in.region->region,
                                                .hidden_offset = in.hidden_offset,
                                                .hidden_bytes = in.hidden_bytes,
                                                .targets_offset = in.targets_offset,
                                                .targets_bytes = in.targets_bytes,
                                                .grad_hidden_offset = in.grad_hidden_offset,
                                                .grad_hidden_bytes = in.grad_hidden_bytes};
  return absl::OkStatus();
}

int PathOf(const client::StepResult& r) {
  if (r.device) return LH_PATH_DEVICE;
  return r.shared_memory ? LH_PATH_SHARED_MEMORY : LH_PATH_NETWORK;
}

// Every version of StepMany: every micro-batch converted (and checked) before any is sent.
int StepMany(lh_client* client, const lh_microbatch* mbs, const lh_microbatch_inputs* inputs,
             const lh_device_tensors* devices, size_t count, size_t pipeline_depth,
             lh_step_result* results, int* paths, lh_status* status) {
  return Guarded(status, [&]() -> absl::Status {
    if (client == nullptr) return absl::InvalidArgumentError("null client");
    if (count > 0 && (mbs == nullptr || results == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(count, " micro-batches with a null ",
                                                     mbs == nullptr ? "mbs" : "results", " array"));
    }
    std::vector<client::Microbatch> batch;
    batch.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      auto mb = ToMicrobatch(mbs[i]);
      if (!mb.ok()) return mb.status();
      if (inputs != nullptr) {
        if (absl::Status added = AddInputs(inputs[i], i, *mb); !added.ok()) return added;
      }
      if (devices != nullptr) {
        if (absl::Status added = AddDevice(devices[i], i, *mb); !added.ok()) return added;
      }
      batch.push_back(*std::move(mb));
    }
    auto answers = client->client->StepMany(batch, std::max<size_t>(1, pipeline_depth));
    for (size_t i = 0; i < count; ++i) {
      results[i] = lh_step_result{};
      Report(ToResult(mbs[i], answers[i], &results[i]), &results[i].status);
      if (paths != nullptr) paths[i] = answers[i].ok() ? PathOf(*answers[i]) : LH_PATH_NETWORK;
    }
    return absl::OkStatus();
  });
}

}  // namespace
}  // namespace losshead::capi

extern "C" {

int lh_step_many(lh_client* client, const lh_microbatch* mbs, size_t count, size_t pipeline_depth,
                 lh_step_result* results, lh_status* status) {
  return losshead::capi::StepMany(client, mbs, nullptr, nullptr, count, pipeline_depth, results,
                                  nullptr, status);
}

int lh_step_many_with_inputs(lh_client* client, const lh_microbatch* mbs,
                             const lh_microbatch_inputs* inputs, size_t count,
                             size_t pipeline_depth, lh_step_result* results, lh_status* status) {
  return losshead::capi::StepMany(client, mbs, inputs, nullptr, count, pipeline_depth, results,
                                  nullptr, status);
}

int lh_step_many_device(lh_client* client, const lh_microbatch* mbs,
                        const lh_microbatch_inputs* inputs, const lh_device_tensors* devices,
                        size_t count, size_t pipeline_depth, lh_step_result* results, int* paths,
                        lh_status* status) {
  return losshead::capi::StepMany(client, mbs, inputs, devices, count, pipeline_depth, results,
                                  paths, status);
}

int lh_same_node_devices(lh_client* client, lh_same_node_device* out, size_t capacity,
                         size_t* count, lh_status* status) {
  return losshead::capi::Guarded(status, [&]() -> absl::Status {
    if (client == nullptr) return absl::InvalidArgumentError("null client");
    if (capacity > 0 && out == nullptr) return absl::InvalidArgumentError("null out");
    const std::vector<losshead::client::SameNodeDevice> devices = client->client->SameNodeDevices();
    for (size_t i = 0; i < devices.size() && i < capacity; ++i) {
      out[i] = lh_same_node_device{};
      out[i].index = devices[i].index;
      std::snprintf(out[i].pci_bus_id, sizeof(out[i].pci_bus_id), "%s",
                    devices[i].pci_bus_id.c_str());
    }
    if (count != nullptr) *count = devices.size();
    return absl::OkStatus();
  });
}

int lh_device_region_register(lh_client* client, const void* ipc_handle, size_t handle_bytes,
                              uint64_t offset, uint64_t bytes, const char* pci_bus_id,
                              lh_device_region** out, lh_status* status) {
  return losshead::capi::Guarded(status, [&]() -> absl::Status {
    if (client == nullptr || out == nullptr) {
      return absl::InvalidArgumentError("null client or out");
    }
    if (ipc_handle == nullptr && handle_bytes > 0) {
      return absl::InvalidArgumentError("null ipc_handle");
    }
    *out = nullptr;
    auto region = client->client->RegisterDeviceRegion(
        std::string_view(static_cast<const char*>(ipc_handle), handle_bytes), offset, bytes,
        pci_bus_id == nullptr ? "" : pci_bus_id);
    if (!region.ok()) return region.status();
    *out = new lh_device_region{*std::move(region)};
    return absl::OkStatus();
  });
}

void lh_device_region_free(lh_device_region* region) { delete region; }

}  // extern "C"
