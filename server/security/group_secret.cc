#include "server/security/group_secret.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/read_file.h"

namespace losshead::server {

absl::StatusOr<GroupSecret> GroupSecret::FromText(absl::string_view text) {
  const absl::string_view secret = absl::StripAsciiWhitespace(text);
  if (secret.size() < kMinGroupSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a group secret of ", secret.size(),
                                                   " bytes (at least ", kMinGroupSecretBytes,
                                                   "; 32 random bytes, base64, are plenty)"));
  }
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(kProcessControlLabel.data()),
       kProcessControlLabel.size(), mac, &length);
  std::string authorization = absl::StrCat(
      "Bearer ",
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(mac), length)));
  return GroupSecret(std::string(secret), std::move(authorization));
}

absl::StatusOr<GroupSecret> GroupSecret::FromFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path, "--group_secret_file");
  if (!text.ok()) return text.status();
  absl::StatusOr<GroupSecret> secret = FromText(*text);
  if (!secret.ok()) {
    return absl::Status(secret.status().code(), absl::StrCat("--group_secret_file '", path,
                                                             "': ", secret.status().message()));
  }
  return secret;
}

bool GroupSecret::Matches(absl::string_view authorization) const {
  authorization = absl::StripAsciiWhitespace(authorization);
  // The length is no secret (every credential has the same); the bytes are compared in full.
  return authorization.size() == authorization_.size() &&
         CRYPTO_memcmp(authorization.data(), authorization_.data(), authorization_.size()) == 0;
}

}  // namespace losshead::server
