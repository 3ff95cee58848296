#include "server/security/security.h"

#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/read_file.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace losshead::server {
namespace {

struct BioDeleter {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

std::unique_ptr<BIO, BioDeleter> MemoryBio(const std::string& pem) {
  return std::unique_ptr<BIO, BioDeleter>(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

std::unique_ptr<X509, X509Deleter> FirstCertificate(const std::string& pem) {
  auto bio = MemoryBio(pem);
  return std::unique_ptr<X509, X509Deleter>(
      PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
}

// gRPC accepts any bytes here and fails each handshake later with a terse log line; checking the
// PEM contents at start turns a typo in a path or a swapped file into a refusal to start.
absl::Status CheckCertAndKey(const std::string& cert_pem, const std::string& cert_path,
                             const std::string& key_pem, const std::string& key_path) {
  auto cert = FirstCertificate(cert_pem);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert '", cert_path, "' holds no PEM certificate"));
  }
  auto key_bio = MemoryBio(key_pem);
  std::unique_ptr<EVP_PKEY, PkeyDeleter> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key '", key_path, "' holds no (unencrypted) PEM private key"));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key '", key_path, "' is not the key of --tls_cert '", cert_path, "'"));
  }
  return absl::OkStatus();
}

// How a process of a group reaches its peers' gRPC ports: as its own clients reach it. Under TLS
// the peers' certificates are verified against the group's root CA; under mTLS this process
// presents its own certificate, which its peers verify as a client's.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> GroupChannel(
    const SecurityOptions& options) {
  if (options.tls_cert_file.empty()) {
    if (!options.group_tls_root_ca_file.empty()) {
      return absl::InvalidArgumentError("--group_tls_root_ca needs --tls_cert and --tls_key");
    }
    return grpc::InsecureChannelCredentials();
  }
  const std::string& ca_file = options.group_tls_root_ca_file.empty()
                                   ? options.tls_client_ca_file
                                   : options.group_tls_root_ca_file;
  if (ca_file.empty()) {
    return absl::InvalidArgumentError(
        "a process of a group serving TLS verifies its peers' certificates: give "
        "--group_tls_root_ca (the CA that signed the processes' --tls_cert), or --tls_client_ca");
  }
  absl::StatusOr<std::string> ca = ReadFileToString(
      ca_file, options.group_tls_root_ca_file.empty() ? "--tls_client_ca" : "--group_tls_root_ca");
  if (!ca.ok()) return ca.status();
  if (FirstCertificate(*ca) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("'", ca_file, "' holds no PEM certificate"));
  }
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = *ca;
  if (!options.tls_client_ca_file.empty()) {
    absl::StatusOr<std::string> cert = ReadFileToString(options.tls_cert_file, "--tls_cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFileToString(options.tls_key_file, "--tls_key");
    if (!key.ok()) return key.status();
    // Its peers require client certificates: this one must be usable as one (an extended key
    // usage without clientAuth fails every handshake with the peers, long after the start).
    auto parsed = FirstCertificate(*cert);
    if (parsed == nullptr || X509_check_purpose(parsed.get(), X509_PURPOSE_SSL_CLIENT, 0) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls_cert '", options.tls_cert_file,
          "' is not a client certificate, and with --tls_client_ca the processes of a group "
          "present it to each other: give it the clientAuth extended key usage beside "
          "serverAuth"));
    }
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<ServerSecurity> LoadServerSecurity(const SecurityOptions& options,
                                                  Metrics* metrics) {
  ServerSecurity security;
  const bool has_cert = !options.tls_cert_file.empty();
  if (has_cert != !options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key must be given together");
  }
  if (!options.tls_client_ca_file.empty() && !has_cert) {
    return absl::InvalidArgumentError("--tls_client_ca (mTLS) needs --tls_cert and --tls_key");
  }
  if (!options.group &&
      (!options.group_secret_file.empty() || !options.group_tls_root_ca_file.empty() ||
       options.group_mesh_encryption)) {
    return absl::InvalidArgumentError(
        "--group_secret_file, --group_tls_root_ca and --group_mesh_encryption are for a process of "
        "a group (--group_peers)");
  }
  if (options.group_mesh_encryption && options.group_secret_file.empty()) {
    return absl::InvalidArgumentError(
        "--group_mesh_encryption needs --group_secret_file: the mesh's keys come from the secret");
  }
  if (options.group) {
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> channel = GroupChannel(options);
    if (!channel.ok()) return channel.status();
    security.group_channel = std::move(*channel);
    if (!options.group_secret_file.empty()) {
      absl::StatusOr<GroupSecret> secret = GroupSecret::FromFile(options.group_secret_file);
      if (!secret.ok()) return secret.status();
      security.group_secret = std::make_shared<const GroupSecret>(*std::move(secret));
    }
  }
  if (!options.auth_tokens_file.empty()) {
    absl::StatusOr<std::shared_ptr<const TokenAuthenticator>> tokens =
        TokenAuthenticator::FromFile(options.auth_tokens_file);
    if (!tokens.ok()) return tokens.status();
    security.tokens = std::make_shared<TokenTable>(std::move(*tokens));
  }
  if (!options.metrics_basic_auth_file.empty()) {
    absl::StatusOr<std::string> text =
        ReadFileToString(options.metrics_basic_auth_file, "metrics basic-auth file");
    if (!text.ok()) return text.status();
    const std::string line(absl::StripAsciiWhitespace(*text));
    const size_t colon = line.find(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == line.size() ||
        line.find('\n') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("metrics basic-auth file '",
                                                     options.metrics_basic_auth_file,
                                                     "' must hold one 'user:password' line"));
    }
    security.metrics_basic_auth = line;
  }

  std::shared_ptr<grpc::ServerCredentials> credentials;
  if (has_cert) {
    absl::StatusOr<std::string> cert = ReadFileToString(options.tls_cert_file, "--tls_cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFileToString(options.tls_key_file, "--tls_key");
    if (!key.ok()) return key.status();
    if (absl::Status s = CheckCertAndKey(*cert, options.tls_cert_file, *key, options.tls_key_file);
        !s.ok()) {
      return s;
    }
    grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    if (!options.tls_client_ca_file.empty()) {
      absl::StatusOr<std::string> ca =
          ReadFileToString(options.tls_client_ca_file, "--tls_client_ca");
      if (!ca.ok()) return ca.status();
      if (FirstCertificate(*ca) == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--tls_client_ca '", options.tls_client_ca_file, "' holds no PEM certificate"));
      }
      ssl.pem_root_certs = *ca;
      ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
      security.mtls = true;
    }
    ssl.pem_key_cert_pairs.push_back({.private_key = *key, .cert_chain = *cert});
    credentials = grpc::SslServerCredentials(ssl);
    security.tls = true;
    if (security.tokens != nullptr) {
      credentials->SetAuthMetadataProcessor(
          std::make_shared<BearerTokenProcessor>(security.tokens, metrics, security.group_secret));
    }
  } else if (security.tokens != nullptr) {
    credentials = PlaintextCredentialsWithProcessor(
        std::make_shared<BearerTokenProcessor>(security.tokens, metrics, security.group_secret));
  } else {
    credentials = grpc::InsecureServerCredentials();
  }
  security.credentials = std::move(credentials);
  return security;
}

absl::StatusOr<size_t> ReloadTokens(const std::string& tokens_file, TokenTable& tokens) {
  absl::StatusOr<std::shared_ptr<const TokenAuthenticator>> loaded =
      TokenAuthenticator::FromFile(tokens_file);
  if (!loaded.ok()) return loaded.status();
  const size_t count = (*loaded)->size();
  tokens.Replace(std::move(*loaded));
  return count;
}

}  // namespace losshead::server
