// The client handle: options from the C struct, connect, token, retry count, status reports.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <new>
#include <string>

#include "absl/time/time.h"
#include "internal.h"
#include "losshead/client/retry.h"
#include "losshead/client/step_stream.h"
#include "transport/heap_tuning.h"

namespace losshead::capi {
namespace {

std::string OrEmpty(const char* s) { return s == nullptr ? std::string() : std::string(s); }

absl::StatusOr<client::ClientOptions> ToClientOptions(const lh_client_options* in) {
  client::ClientOptions out;
  if (in == nullptr) return out;
  if (in->max_message_bytes != 0) out.max_message_bytes = in->max_message_bytes;
  out.max_receive_message_bytes = in->max_receive_message_bytes;
  out.deadline = in->deadline_s > 0 ? absl::Seconds(in->deadline_s) : absl::InfiniteDuration();
  out.dedicated_connection = in->dedicated_connection != 0;
  out.bearer_token = OrEmpty(in->bearer_token);
  out.tls_server_name = OrEmpty(in->tls_server_name);
  const std::string cert = OrEmpty(in->tls_cert_pem);
  const std::string key = OrEmpty(in->tls_key_pem);
  if (in->tls != 0 || in->tls_root_pem != nullptr || !cert.empty() || !key.empty()) {
    // PEM contents rather than files: the caller reads (and reports) its own files.
    if (cert.empty() != key.empty()) {
      return absl::InvalidArgumentError("a TLS client certificate and its key go together");
    }
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = OrEmpty(in->tls_root_pem);
    ssl.pem_cert_chain = cert;
    ssl.pem_private_key = key;
    out.credentials = grpc::SslCredentials(ssl);
  }
  if (in->retry_max_attempts > 0) {
    out.retry.max_attempts = in->retry_max_attempts;
    out.retry.initial_backoff = absl::Seconds(in->retry_initial_backoff_s);
    out.retry.max_backoff = absl::Seconds(in->retry_max_backoff_s);
    out.retry.multiplier = in->retry_multiplier;
    out.retry.jitter = in->retry_jitter;
  }
  for (size_t i = 0; i < in->num_channel_args; ++i) {
    out.channel_args.emplace_back(OrEmpty(in->channel_args[i].key), in->channel_args[i].value);
  }
  for (size_t i = 0; i < in->num_metadata; ++i) {
    out.metadata.emplace_back(OrEmpty(in->metadata[i].key), OrEmpty(in->metadata[i].value));
  }
  return out;
}

// gRPC's message buffers stay mapped between messages (transport/heap_tuning.h), once per
// process; a process that tunes its allocator itself sets LOSSHEAD_TUNE_MALLOC=0.
void KeepReceiveBuffersMapped() {
  static std::once_flag once;
  std::call_once(once, [] { transport::KeepTransferBuffersMapped(); });
}

}  // namespace

int Report(const absl::Status& status, lh_status* out) {
  const int code = static_cast<int>(status.code());
  if (out == nullptr) return code;
  out->code = code;
  out->retry_after_ms = 0;
  if (auto hint = client::RetryAfter(status); hint.has_value()) {
    out->retry_after_ms = static_cast<uint32_t>(absl::ToInt64Milliseconds(*hint));
  }
  out->microbatch = client::IsMicrobatchError(status) ? 1 : 0;
  const size_t n = std::min(status.message().size(), sizeof(out->message) - 1);
  std::memcpy(out->message, status.message().data(), n);
  out->message[n] = '\0';
  return code;
}

int Guarded(lh_status* out, absl::FunctionRef<absl::Status()> body) {
  try {
    return Report(body(), out);
  } catch (const std::bad_alloc&) {
    return Report(absl::ResourceExhaustedError("out of host memory"), out);
  } catch (...) {
    return Report(absl::InternalError("unexpected C++ exception in liblosshead_capi"), out);
  }
}

}  // namespace losshead::capi

extern "C" {

int lh_capi_version(void) { return LH_CAPI_VERSION; }

int lh_client_connect(const char* target, const lh_client_options* options, lh_client** out,
                      lh_status* status) {
  return losshead::capi::Guarded(status, [&]() -> absl::Status {
    if (out == nullptr) return absl::InvalidArgumentError("null output handle");
    *out = nullptr;
    losshead::capi::KeepReceiveBuffersMapped();
    auto client_options = losshead::capi::ToClientOptions(options);
    if (!client_options.ok()) return client_options.status();
    auto client =
        losshead::client::Client::Connect(target == nullptr ? "" : target, *client_options);
    if (!client.ok()) return client.status();
    *out = new lh_client{std::move(*client)};
    return absl::OkStatus();
  });
}

void lh_client_free(lh_client* client) { delete client; }

void lh_client_set_token(lh_client* client, const char* token) {
  client->client->SetBearerToken(token == nullptr ? "" : token);
}

uint64_t lh_client_retries(const lh_client* client) { return client->client->retries(); }

}  // extern "C"
