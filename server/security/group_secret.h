// The secret the processes of a group share (--group_secret_file, docs/multi-process.md "Security
// between processes"): its bytes authenticate the peers of the process group's TCP mesh at
// bootstrap (kernels ProcessGroupOptions::secret), and a bearer credential derived from it
// authenticates the processes to each other on ProcessControl, where a client's token is not
// needed (the process its client called checked that token).
//
// The credential is "Bearer " + hex(HMAC-SHA256(secret, kProcessControlLabel)): not the secret
// itself, so that a credential seen by something in between (a proxy that ends TLS) does not open
// the mesh. It is accepted on ProcessControl only: the token table never holds it, so a LossHead
// call presenting it is UNAUTHENTICATED like any unknown token. Never logged.
#ifndef LOSSHEAD_SERVER_SECURITY_GROUP_SECRET_H_
#define LOSSHEAD_SERVER_SECURITY_GROUP_SECRET_H_

#include <cstddef>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace losshead::server {

inline constexpr size_t kMinGroupSecretBytes = 16;
inline constexpr absl::string_view kProcessControlLabel = "losshead ProcessControl credential v1";

class GroupSecret {
 public:
  // The file's bytes, without surrounding whitespace (a trailing newline is common). NOT_FOUND /
  // PERMISSION_DENIED when it cannot be read; INVALID_ARGUMENT (naming the file) when fewer than
  // kMinGroupSecretBytes remain.
  static absl::StatusOr<GroupSecret> FromFile(const std::string& path);
  static absl::StatusOr<GroupSecret> FromText(absl::string_view text);

  // What the mesh's bootstrap checks (ProcessGroupOptions::secret).
  const std::string& secret() const { return secret_; }
  // The `authorization` header value a process sends its peers on ProcessControl.
  const std::string& authorization() const { return authorization_; }
  // Whether `authorization` is that value; in constant time.
  bool Matches(absl::string_view authorization) const;

 private:
  GroupSecret(std::string secret, std::string authorization)
      : secret_(std::move(secret)), authorization_(std::move(authorization)) {}
  std::string secret_;
  std::string authorization_;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_SECURITY_GROUP_SECRET_H_
