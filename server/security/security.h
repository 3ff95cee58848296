// Transport security and authentication of a server, loaded at start from the files its options
// name: TLS / mTLS credentials, the bearer-token table (reloadable, see ReloadTokens) and the
// metrics basic-auth secret.
#ifndef LOSSHEAD_SERVER_SECURITY_SECURITY_H_
#define LOSSHEAD_SERVER_SECURITY_SECURITY_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "server/security/auth.h"
#include "server/security/group_secret.h"
#include "server/security/token_table.h"

namespace losshead::server {

class Metrics;

// The files that configure security, as the process's ServerOptions names them (server/server.h
// copies its same-named fields here: this layer sits below the process); empty: not used.
struct SecurityOptions {
  std::string tls_cert_file;  // with tls_key_file: TLS; both empty: plaintext
  std::string tls_key_file;
  std::string tls_client_ca_file;       // clients must present a certificate it signed (mTLS)
  std::string auth_tokens_file;         // `<role> <token>` lines; every RPC then needs a token
  std::string metrics_basic_auth_file;  // one `user:password` line for /metrics
  // A process of a group (--group_peers): how it reaches its peers' gRPC ports (group_channel).
  bool group = false;
  // The group's shared secret (group_secret.h); empty: none. Only with `group`.
  std::string group_secret_file;
  // The CA that signed the peers' certificates, to verify them when the server serves TLS (empty:
  // tls_client_ca_file's). Only with `group` and TLS.
  std::string group_tls_root_ca_file;
  // Seal the group's own connections (--group_mesh_encryption). Only with `group` and a secret.
  bool group_mesh_encryption = false;
};

struct ServerSecurity {
  std::shared_ptr<grpc::ServerCredentials> credentials;  // never null
  bool tls = false;
  bool mtls = false;
  std::shared_ptr<TokenTable> tokens;             // null without a token file
  std::optional<std::string> metrics_basic_auth;  // "user:password"
  // With `group`: the channel credentials for the peers' gRPC ports (TLS when the server serves
  // TLS, verifying the peers against the group's root CA and, where the server requires client
  // certificates, presenting its own --tls_cert), and the group's secret (null without one),
  // whose credential the token check accepts on ProcessControl only.
  std::shared_ptr<grpc::ChannelCredentials> group_channel;
  std::shared_ptr<const GroupSecret> group_secret;
};

// Reads and checks every file `options` names: the certificate parses, the key is its key, the CA
// parses, the token file is well formed, so that a misconfigured server refuses to start with the
// file's name in the error instead of failing its first handshake. INVALID_ARGUMENT for
// inconsistent options or bad contents (a process of a group serving TLS without a root CA for
// its peers; under mTLS, a --tls_cert that may not be a client's certificate, which its peers
// would refuse); NOT_FOUND for a file that cannot be read. Token refusals
// are counted in `metrics` when it is not null.
absl::StatusOr<ServerSecurity> LoadServerSecurity(const SecurityOptions& options,
                                                  Metrics* metrics = nullptr);

// Re-reads `tokens_file` (auth_tokens_file) into `tokens`: on success calls that start from now on
// are checked against the new tokens (a token removed from the file is refused at once). On error
// (NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT as for LoadServerSecurity) nothing changes and
// the old tokens stay in force. Returns the number of tokens loaded.
absl::StatusOr<size_t> ReloadTokens(const std::string& tokens_file, TokenTable& tokens);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_SECURITY_SECURITY_H_
