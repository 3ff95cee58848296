// Transport security and authentication of a server, loaded once at start from the files its
// options name: TLS / mTLS credentials, the bearer-token table and the metrics basic-auth secret.
#ifndef LOSSHEAD_SERVER_SECURITY_H_
#define LOSSHEAD_SERVER_SECURITY_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"
#include "server/auth.h"
#include "server/server.h"

namespace losshead::server {

struct ServerSecurity {
  std::shared_ptr<grpc::ServerCredentials> credentials;  // never null
  bool tls = false;
  bool mtls = false;
  std::shared_ptr<const TokenAuthenticator> tokens;       // null without a token file
  std::optional<std::string> metrics_basic_auth;          // "user:password"
};

// Reads and checks every file ServerOptions names (tls_*, auth_tokens_file,
// metrics_basic_auth_file): the certificate parses, the key is its key, the CA parses, the
// token file is well formed, so that a misconfigured server refuses to start with the file's
// name in the error instead of failing its first handshake. INVALID_ARGUMENT for inconsistent
// options or bad contents; NOT_FOUND for a file that cannot be read.
absl::StatusOr<ServerSecurity> LoadServerSecurity(const ServerOptions& options);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_SECURITY_H_
