#include "channel_security.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace losshead::client::internal {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read ", what, " '", path, "': ", std::strerror(errno)));
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

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
    absl::StatusOr<std::string> roots = ReadPem(options.tls_root_ca_file, "TLS root CA");
    if (!roots.ok()) return roots.status();
    ssl.pem_root_certs = *roots;
  }
  if (!options.tls_cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPem(options.tls_cert_file, "TLS client certificate");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPem(options.tls_key_file, "TLS client key");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace losshead::client::internal
