// Channel credentials from ClientOptions' TLS fields (files read at Connect).
#ifndef LOSSHEAD_CLIENT_SRC_CHANNEL_SECURITY_H_
#define LOSSHEAD_CLIENT_SRC_CHANNEL_SECURITY_H_

#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/status/statusor.h"
#include "losshead/client/client.h"

namespace losshead::client::internal {

// options.credentials when set; TLS (with a client certificate for mTLS) when any TLS field is
// set; plaintext otherwise. NOT_FOUND for an unreadable file, INVALID_ARGUMENT for a client
// certificate without its key or the reverse.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientOptions& options);

// Whether any TLS field is set (then the channel speaks TLS).
bool WantsTls(const ClientOptions& options);

}  // namespace losshead::client::internal

#endif  // LOSSHEAD_CLIENT_SRC_CHANNEL_SECURITY_H_
