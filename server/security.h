// Transport security and authentication of a server, loaded at start from the files its options
// name: TLS / mTLS credentials, the bearer-token table (reloadable, see ReloadTokens) and the
// metrics basic-auth secret.
#ifndef LOSSHEAD_SERVER_SECURITY_H_
#define LOSSHEAD_SERVER_SECURITY_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"
#include "server/auth.h"
#include "server/server.h"
#include "server/token_table.h"

namespace losshead::server {

class Metrics;

struct ServerSecurity {
  std::shared_ptr<grpc::ServerCredentials> credentials;  // never null
  bool tls = false;
  bool mtls = false;
  std::shared_ptr<TokenTable> tokens;             // null without a token file
  std::optional<std::string> metrics_basic_auth;  // "user:password"
};

// Reads and checks every file ServerOptions names (tls_*, auth_tokens_file,
// metrics_basic_auth_file): the certificate parses, the key is its key, the CA parses, the
// token file is well formed, so that a misconfigured server refuses to start with the file's
// name in the error instead of failing its first handshake. INVALID_ARGUMENT for inconsistent
// options or bad contents; NOT_FOUND for a file that cannot be read.
// Token refusals are counted in `metrics` when it is not null.
absl::StatusOr<ServerSecurity> LoadServerSecurity(const ServerOptions& options,
                                                  Metrics* metrics = nullptr);

// Re-reads options.auth_tokens_file into `tokens`: on success calls that start from now on are
// checked against the new tokens (a token removed from the file is refused at once). On error
// (NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT as for LoadServerSecurity) nothing changes and
// the old tokens stay in force. Returns the number of tokens loaded.
absl::StatusOr<size_t> ReloadTokens(const ServerOptions& options, TokenTable& tokens);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_SECURITY_H_
