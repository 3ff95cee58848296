// Bearer-token authentication and role-based authorisation of every RPC.
//
// Tokens come from a file (read at start and on SIGHUP, see server/security/token_table.h), one
// per line: `<role> <token>` with role `reader` or `writer` (a writer may do everything a reader
// may), '#' starts a comment, tokens are at least 16 characters of printable ASCII without spaces.
// Only SHA-256 digests of the tokens are kept, and a presented token is compared against every one
// of them with CRYPTO_memcmp and without an early exit, so neither the time nor the memory of the
// server tells which token, or which prefix of one, came close.
//
// The check runs as a grpc::AuthMetadataProcessor, before any handler: a refused call never
// reaches the service. The decision uses the call's full method name (`:path`):
//   - grpc.health.v1.Health and the reflection services are open (probes carry no token);
//   - methods in the role table need that role;
//   - any other method is denied (PERMISSION_DENIED), so an RPC added to the service without a
//     row in the table is closed until someone decides who may call it.
// No or unknown token: UNAUTHENTICATED. A known token without the role: PERMISSION_DENIED.
// Tokens are never logged nor put in error messages.
#ifndef LOSSHEAD_SERVER_SECURITY_AUTH_H_
#define LOSSHEAD_SERVER_SECURITY_AUTH_H_

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/server_credentials.h"

namespace losshead::server {

// Ordered: a role grants everything the roles below it grant.
enum class Role : int { kNone = 0, kReader = 1, kWriter = 2 };

absl::string_view RoleName(Role role);

// What a method needs. kOpen: no token at all; kDenied: nobody may call it.
enum class Access { kOpen, kReader, kWriter, kDenied };

// The access rule for a full method name ("/losshead.v1.LossHead/Step").
Access RequiredAccess(absl::string_view full_method);

class TokenAuthenticator {
 public:
  // Parses the token file's text; INVALID_ARGUMENT (with the line number, never the token) for a
  // bad role, a short token, a duplicate token or a file without tokens.
  static absl::StatusOr<std::shared_ptr<const TokenAuthenticator>> FromText(absl::string_view text);
  // Reads and parses `path`; NOT_FOUND / PERMISSION_DENIED when it cannot be read.
  static absl::StatusOr<std::shared_ptr<const TokenAuthenticator>> FromFile(
      const std::string& path);

  // The role of the token in an `authorization` header value ("Bearer <token>"); kNone for a
  // missing, malformed or unknown one. Takes the same time whichever stored token matches.
  Role Authenticate(absl::string_view authorization) const;

  // OK, UNAUTHENTICATED or PERMISSION_DENIED for a call of `full_method` with that header.
  absl::Status Authorize(absl::string_view full_method, absl::string_view authorization) const;

  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::array<uint8_t, 32> digest;
    Role role;
  };
  explicit TokenAuthenticator(std::vector<Entry> entries) : entries_(std::move(entries)) {}
  std::vector<Entry> entries_;
};

// PullGradient with reset empties the accumulator writers fill, so it needs the writer role; the
// method-level check lets readers pull. OK without tokens (null) or with a writer's token in the
// call's metadata; PERMISSION_DENIED otherwise (the call got past the method check, so its token
// is a known one).
class Metrics;
class TokenTable;

absl::Status AuthorizePullReset(
    const TokenTable* tokens,
    const std::multimap<grpc::string_ref, grpc::string_ref>& client_metadata);

// A long-lived call (a Step stream) is authorised when it opens; this re-checks its token against
// the table's current tokens, as a call opened now would be checked: a token removed or demoted by
// a reload stops working on streams already open. OK without tokens (null).
absl::Status AuthorizeOpenCall(
    const TokenTable* tokens, absl::string_view full_method,
    const std::multimap<grpc::string_ref, grpc::string_ref>& client_metadata);

// Who presents an `authorization` header value, for binding something to the token that made it
// (a same-node region, server/rpc/shared_regions.h): the SHA-256 of its bearer token, "" without
// tokens (null) or for a value that is not a bearer token. Never logged.
std::string CallerIdentity(const TokenTable* tokens, absl::string_view authorization);
// The same for a call's metadata.
std::string CallerIdentity(
    const TokenTable* tokens,
    const std::multimap<grpc::string_ref, grpc::string_ref>& client_metadata);

// Runs TokenAuthenticator::Authorize on each call's initial metadata. Non-blocking: the check is a
// few hashes, so it runs inline on the transport thread instead of a thread hop per call.
// The table's current tokens decide, so a reload applies to every call that starts after it.
// Refusals are counted in `metrics` (if not null) as failures_total{method, reason}; the method
// label is a LossHead method name, or "other" for any name outside the role table, so that callers
// cannot mint label values.
//
// With a group secret (group_secret.h), its credential is accepted on ProcessControl's methods as
// well (the processes of the group calling each other), and on nothing else.
class GroupSecret;

class BearerTokenProcessor final : public grpc::AuthMetadataProcessor {
 public:
  BearerTokenProcessor(std::shared_ptr<const TokenTable> tokens, Metrics* metrics,
                       std::shared_ptr<const GroupSecret> group = nullptr)
      : tokens_(std::move(tokens)), metrics_(metrics), group_(std::move(group)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  std::shared_ptr<const TokenTable> tokens_;
  Metrics* const metrics_;
  const std::shared_ptr<const GroupSecret> group_;
};

// Plaintext (no TLS) server credentials that still run `processor` on every call.
// grpc::InsecureServerCredentials() refuses an AuthMetadataProcessor, yet the core's insecure
// credentials accept one; tokens over plaintext make sense on loopback or behind a proxy that
// terminates TLS.
std::shared_ptr<grpc::ServerCredentials> PlaintextCredentialsWithProcessor(
    std::shared_ptr<grpc::AuthMetadataProcessor> processor);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_SECURITY_AUTH_H_
