// The bearer tokens a running server accepts, replaceable without a restart (losshead-server
// re-reads --auth_tokens_file on SIGHUP), so that a token can be rotated or revoked in place.
// A call is checked against the table current when it starts; calls already running keep going.
#ifndef LOSSHEAD_SERVER_SECURITY_TOKEN_TABLE_H_
#define LOSSHEAD_SERVER_SECURITY_TOKEN_TABLE_H_

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/security/auth.h"

namespace losshead::server {

class TokenTable {
 public:
  explicit TokenTable(std::shared_ptr<const TokenAuthenticator> tokens)
      : current_(std::move(tokens)) {}

  // Never null. The caller's copy stays valid across a concurrent Replace.
  std::shared_ptr<const TokenAuthenticator> Current() const {
    absl::ReaderMutexLock lock(&mu_);
    return current_;
  }

  void Replace(std::shared_ptr<const TokenAuthenticator> tokens) {
    absl::MutexLock lock(&mu_);
    current_ = std::move(tokens);
  }

 private:
  mutable absl::Mutex mu_;
  std::shared_ptr<const TokenAuthenticator> current_ ABSL_GUARDED_BY(mu_);
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_SECURITY_TOKEN_TABLE_H_
