#include "channel_security.h"

#include <string>

#include "absl/status/status.h"
#include "common/read_file.h"

namespace losshead::client::internal {

bool WantsTls(const ClientOptions& options) {
  return options.tls || !options.tls_root_ca_file.empty() || !options.tls_cert_file.empty() ||
         !options.tls_key_file.empty();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientOptions& options) {
  if (options.credentials != nullptr) return options.credentials;
  if (!WantsTls(options)) return grpc::InsecureChannelCredentials();
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("a TLS client certificate and its key go together");
  }
  grpc::SslCredentialsOptions ssl;  // empty roots: the system's
  if (!options.tls_root_ca_file.empty()) {
    absl::StatusOr<std::string> roots = ReadFileToString(options.tls_root_ca_file, "TLS root CA");
    if (!roots.ok()) return roots.status();
    ssl.pem_root_certs = *roots;
  }
  if (!options.tls_cert_file.empty()) {
    absl::StatusOr<std::string> cert =
        ReadFileToString(options.tls_cert_file, "TLS client certificate");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFileToString(options.tls_key_file, "TLS client key");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace losshead::client::internal
