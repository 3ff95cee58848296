// Connecting to the server as the connection flags say.
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"

namespace {

// The token is kept in a file, not a flag, so that it never shows in `ps` or shell history.
absl::StatusOr<std::string> ReadToken(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read --token_file '", path, "'"));
  std::string line;
  while (std::getline(in, line)) {
    const absl::string_view token = absl::StripAsciiWhitespace(line);
    if (!token.empty() && token.front() != '#') return std::string(token);
  }
  return absl::InvalidArgumentError(absl::StrCat("--token_file '", path, "' holds no token"));
}

}  // namespace

namespace losshead::cli {

absl::StatusOr<std::unique_ptr<client::Client>> ConnectFromFlags(bool dedicated_connection,
                                                                 bool same_node) {
  client::ClientOptions options;
  options.same_node = same_node;
  options.max_message_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_message_bytes));
  options.deadline = absl::Seconds(absl::GetFlag(FLAGS_deadline_s));
  options.dedicated_connection = dedicated_connection;
  options.tls_root_ca_file = absl::GetFlag(FLAGS_tls_root_ca);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    absl::StatusOr<std::string> token = ReadToken(path);
    if (!token.ok()) return token.status();
    options.bearer_token = *std::move(token);
  }
  return client::Client::Connect(absl::GetFlag(FLAGS_server), options);
}

}  // namespace losshead::cli
