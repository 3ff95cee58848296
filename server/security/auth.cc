#include "server/security/auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <algorithm>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/read_file.h"
#include "grpc/grpc_security.h"
#include "server/observability/metrics.h"
#include "server/security/group_secret.h"
#include "server/security/token_table.h"

namespace losshead::server {
namespace {

constexpr size_t kMinTokenChars = 16;

struct MethodRule {
  absl::string_view method;
  Access access;
};

// One row per RPC of losshead.v1.LossHead. A method missing here is denied to everyone.
// PullGradient is a reader's call; its `reset` mutates state and is checked for the writer role
// by the handler (the request body is not visible here).
constexpr MethodRule kLossHeadRules[] = {
    {"/losshead.v1.LossHead/GetHead", Access::kReader},
    {"/losshead.v1.LossHead/ListHeads", Access::kReader},
    {"/losshead.v1.LossHead/GetStats", Access::kReader},
    {"/losshead.v1.LossHead/PullGradient", Access::kReader},
    {"/losshead.v1.LossHead/DownloadWeights", Access::kReader},
    {"/losshead.v1.LossHead/EmbeddingRows", Access::kReader},
    {"/losshead.v1.LossHead/GetClientProgress", Access::kReader},
    {"/losshead.v1.LossHead/ListSnapshots", Access::kReader},
    {"/losshead.v1.LossHead/CreateHead", Access::kWriter},
    {"/losshead.v1.LossHead/DeleteHead", Access::kWriter},
    {"/losshead.v1.LossHead/SetLossOptions", Access::kWriter},
    {"/losshead.v1.LossHead/Step", Access::kWriter},
    {"/losshead.v1.LossHead/PushWeights", Access::kWriter},
    {"/losshead.v1.LossHead/Checkpoint", Access::kWriter},
    {"/losshead.v1.LossHead/SetOptimizer", Access::kWriter},
    {"/losshead.v1.LossHead/ApplyOptimizer", Access::kWriter},
    {"/losshead.v1.LossHead/RestoreHead", Access::kWriter},
    {"/losshead.v1.LossHead/DeleteSnapshot", Access::kWriter},
    // Between the processes of a group (process_control.proto): a reader's token gets in, and the
    // handler checks it against the LossHead method the request stands for.
    {"/losshead.v1.ProcessControl/Lead", Access::kReader},
    {"/losshead.v1.ProcessControl/Apply", Access::kReader},
    {"/losshead.v1.ProcessControl/Members", Access::kReader},
};

constexpr absl::string_view kProcessControlPrefix = "/losshead.v1.ProcessControl/";

// Services that must answer without a token: probes and tooling discovery.
constexpr absl::string_view kOpenServicePrefixes[] = {
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
};

std::array<uint8_t, 32> Sha256(absl::string_view text) {
  std::array<uint8_t, 32> digest;
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest.data());
  return digest;
}

bool PrintableToken(absl::string_view token) {
  return std::all_of(token.begin(), token.end(), [](char c) { return c > ' ' && c < 127; });
}

}  // namespace

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kReader:
      return "reader";
    case Role::kWriter:
      return "writer";
    case Role::kNone:
      break;
  }
  return "none";
}

Access RequiredAccess(absl::string_view full_method) {
  for (absl::string_view prefix : kOpenServicePrefixes) {
    if (absl::StartsWith(full_method, prefix)) return Access::kOpen;
  }
  for (const MethodRule& rule : kLossHeadRules) {
    if (rule.method == full_method) return rule.access;
  }
  return Access::kDenied;
}

absl::StatusOr<std::shared_ptr<const TokenAuthenticator>> TokenAuthenticator::FromText(
    absl::string_view text) {
  std::vector<Entry> entries;
  absl::flat_hash_set<std::string> seen;  // digests, to refuse a token listed twice
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("token file line ", line_number, ": expected '<role> <token>'"));
    }
    Role role;
    if (fields[0] == "reader") {
      role = Role::kReader;
    } else if (fields[0] == "writer") {
      role = Role::kWriter;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("token file line ", line_number, ": role must be reader or writer"));
    }
    if (fields[1].size() < kMinTokenChars || !PrintableToken(fields[1])) {
      return absl::InvalidArgumentError(absl::StrCat("token file line ", line_number,
                                                     ": a token must be at least ", kMinTokenChars,
                                                     " printable characters"));
    }
    const std::array<uint8_t, 32> digest = Sha256(fields[1]);
    if (!seen.insert(std::string(digest.begin(), digest.end())).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("token file line ", line_number, ": the token is listed twice"));
    }
    entries.push_back(Entry{digest, role});
  }
  if (entries.empty()) return absl::InvalidArgumentError("the token file lists no token");
  return std::shared_ptr<const TokenAuthenticator>(new TokenAuthenticator(std::move(entries)));
}

absl::StatusOr<std::shared_ptr<const TokenAuthenticator>> TokenAuthenticator::FromFile(
    const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path, "token file");
  if (!text.ok()) return text.status();
  absl::StatusOr<std::shared_ptr<const TokenAuthenticator>> auth = FromText(*text);
  if (!auth.ok()) {
    return absl::Status(auth.status().code(), absl::StrCat(path, ": ", auth.status().message()));
  }
  return auth;
}

Role TokenAuthenticator::Authenticate(absl::string_view authorization) const {
  absl::string_view token = absl::StripAsciiWhitespace(authorization);
  // RFC 6750: the scheme is case-insensitive.
  if (token.size() < 7 || !absl::EqualsIgnoreCase(token.substr(0, 7), "bearer ")) {
    return Role::kNone;
  }
  token = absl::StripLeadingAsciiWhitespace(token.substr(7));
  const std::array<uint8_t, 32> digest = Sha256(token);
  // Every entry is compared, whatever matched before: the time does not depend on which token
  // (if any) matches. Digests are compared, so the time does not depend on the token's length.
  int best = 0;
  for (const Entry& entry : entries_) {
    const int match = CRYPTO_memcmp(digest.data(), entry.digest.data(), digest.size()) == 0;
    best = std::max(best, match * static_cast<int>(entry.role));
  }
  return static_cast<Role>(best);
}

absl::Status TokenAuthenticator::Authorize(absl::string_view full_method,
                                           absl::string_view authorization) const {
  const Access access = RequiredAccess(full_method);
  if (access == Access::kOpen) return absl::OkStatus();
  const Role role = Authenticate(authorization);
  if (role == Role::kNone) {
    return absl::UnauthenticatedError("a valid 'authorization: Bearer <token>' header is required");
  }
  if (access == Access::kDenied) {
    return absl::PermissionDeniedError(
        absl::StrCat("no role may call ", full_method.substr(0, 200)));
  }
  const Role needed = access == Access::kWriter ? Role::kWriter : Role::kReader;
  if (role < needed) {
    return absl::PermissionDeniedError(absl::StrCat(full_method, " needs the ", RoleName(needed),
                                                    " role; the token has ", RoleName(role)));
  }
  return absl::OkStatus();
}

absl::Status AuthorizePullReset(
    const TokenTable* tokens,
    const std::multimap<grpc::string_ref, grpc::string_ref>& client_metadata) {
  if (tokens == nullptr) return absl::OkStatus();
  absl::string_view authorization;
  if (auto it = client_metadata.find("authorization"); it != client_metadata.end()) {
    authorization = absl::string_view(it->second.data(), it->second.size());
  }
  if (tokens->Current()->Authenticate(authorization) < Role::kWriter) {
    return absl::PermissionDeniedError("PullGradient with reset needs the writer role");
  }
  return absl::OkStatus();
}

absl::Status AuthorizeOpenCall(
    const TokenTable* tokens, absl::string_view full_method,
    const std::multimap<grpc::string_ref, grpc::string_ref>& client_metadata) {
  if (tokens == nullptr) return absl::OkStatus();
  absl::string_view authorization;
  if (auto it = client_metadata.find("authorization"); it != client_metadata.end()) {
    authorization = absl::string_view(it->second.data(), it->second.size());
  }
  absl::Status status = tokens->Current()->Authorize(full_method, authorization);
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(status.message(),
                                   " (the token file was reloaded since this stream opened)"));
}

std::string CallerIdentity(const TokenTable* tokens, absl::string_view authorization) {
  if (tokens == nullptr) return "";
  absl::string_view token = absl::StripAsciiWhitespace(authorization);
  if (token.size() < 7 || !absl::EqualsIgnoreCase(token.substr(0, 7), "bearer ")) return "";
  token = absl::StripLeadingAsciiWhitespace(token.substr(7));
  const std::array<uint8_t, 32> digest = Sha256(token);
  return std::string(reinterpret_cast<const char*>(digest.data()), digest.size());
}

std::string CallerIdentity(
    const TokenTable* tokens,
    const std::multimap<grpc::string_ref, grpc::string_ref>& client_metadata) {
  absl::string_view authorization;
  if (auto it = client_metadata.find("authorization"); it != client_metadata.end()) {
    authorization = absl::string_view(it->second.data(), it->second.size());
  }
  return CallerIdentity(tokens, authorization);
}

grpc::Status BearerTokenProcessor::Process(const InputMetadata& auth_metadata,
                                           grpc::AuthContext* /*context*/,
                                           OutputMetadata* /*consumed_auth_metadata*/,
                                           OutputMetadata* /*response_metadata*/) {
  absl::string_view method;
  absl::string_view authorization;
  for (const auto& [key, value] : auth_metadata) {
    const absl::string_view k(key.data(), key.size());
    if (k == ":path") {
      method = absl::string_view(value.data(), value.size());
    } else if (k == "authorization") {
      authorization = absl::string_view(value.data(), value.size());
    }
  }
  if (group_ != nullptr && absl::StartsWith(method, kProcessControlPrefix) &&
      group_->Matches(authorization)) {
    return grpc::Status::OK;  // a process of the group; the handler checks what it may do
  }
  const absl::Status status = tokens_->Current()->Authorize(method, authorization);
  if (status.ok()) return grpc::Status::OK;
  if (metrics_ != nullptr) {
    constexpr absl::string_view kPrefix = "/losshead.v1.LossHead/";
    const bool known =
        absl::StartsWith(method, kPrefix) && RequiredAccess(method) != Access::kDenied;
    metrics_->Failure(known ? method.substr(kPrefix.size()) : "other",
                      static_cast<int>(status.code()));
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

namespace {

class PlaintextWithProcessor final : public grpc::ServerCredentials {
 public:
  explicit PlaintextWithProcessor(std::shared_ptr<grpc::AuthMetadataProcessor> processor)
      : processor_(std::move(processor)) {}

  void SetAuthMetadataProcessor(
      const std::shared_ptr<grpc::AuthMetadataProcessor>& processor) override {
    processor_ = processor;
  }

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    grpc_server_credentials* creds = grpc_insecure_server_credentials_create();
    // The core credentials outlive this object (the server keeps them once the builder is gone),
    // so they own a reference to the processor, dropped by DestroyC.
    grpc_server_credentials_set_auth_metadata_processor(
        creds,
        grpc_auth_metadata_processor{&ProcessC, &DestroyC,
                                     new std::shared_ptr<grpc::AuthMetadataProcessor>(processor_)});
    const int port = grpc_server_add_http2_port(server, addr.c_str(), creds);
    grpc_server_credentials_release(creds);
    return port;
  }

  // The core's callback shape around the C++ processor; it answers synchronously (IsBlocking()
  // is false for the processors used here), so `status`'s message outlives the call of `done`.
  static void ProcessC(void* state, grpc_auth_context* /*context*/, const grpc_metadata* md,
                       size_t num_md, grpc_process_auth_metadata_done_cb done, void* user_data) {
    grpc::AuthMetadataProcessor* processor =
        static_cast<std::shared_ptr<grpc::AuthMetadataProcessor>*>(state)->get();
    grpc::AuthMetadataProcessor::InputMetadata input;
    for (size_t i = 0; i < num_md; ++i) {
      input.emplace(
          grpc::string_ref(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(md[i].key)),
                           GRPC_SLICE_LENGTH(md[i].key)),
          grpc::string_ref(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(md[i].value)),
                           GRPC_SLICE_LENGTH(md[i].value)));
    }
    grpc::AuthMetadataProcessor::OutputMetadata consumed, response;
    const grpc::Status status = processor->Process(input, nullptr, &consumed, &response);
    done(user_data, nullptr, 0, nullptr, 0, static_cast<grpc_status_code>(status.error_code()),
         status.ok() ? nullptr : status.error_message().c_str());
  }

  static void DestroyC(void* state) {
    delete static_cast<std::shared_ptr<grpc::AuthMetadataProcessor>*>(state);
  }

  std::shared_ptr<grpc::AuthMetadataProcessor> processor_;
};

}  // namespace

std::shared_ptr<grpc::ServerCredentials> PlaintextCredentialsWithProcessor(
    std::shared_ptr<grpc::AuthMetadataProcessor> processor) {
  return std::make_shared<PlaintextWithProcessor>(std::move(processor));
}

}  // namespace losshead::server
