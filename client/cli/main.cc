// losshead: command-line client of losshead-server.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "transport/heap_tuning.h"

namespace {

constexpr char kUsage[] =
    "losshead <command> [flags]\n"
    "commands:\n"
    "  demo    train a head end to end: a student learns a random teacher's distribution\n"
    "  bench   stream synthetic micro-batches (bf16 hidden states) through a head of --dtype\n"
    "          and --matmul_precision; report tokens/s and step latency\n"
    "  create  create a head (--head, --vocab, --hidden, --dtype, --matmul_precision,\n"
    "          --init_std, --seed)\n"
    "  list    list heads\n"
    "  delete  delete a head (--head)\n"
    "  stats   print the server's stats\n"
    "  health  exit 0 when the server is SERVING\n"
    "  progress  acknowledged and persisted sequence of --client_id on --head (what a crash\n"
    "          lost: every sequence above persisted)\n"
    "  export  a server checkpoint file to safetensors + a manifest, offline (--checkpoint,\n"
    "          --head, --tag, --out, --tensor, --with_optimizer, --with_gradient, --manifest)\n"
    "  import  create --head from a safetensors tensor and push it as W (--safetensors,\n"
    "          --tensor, --create=false: push into an existing head)\n"
    "common flags: --server, --max_message_bytes, --deadline_s, --token_file, --tls_ca,\n"
    "  --tls_cert, --tls_key, --tls_server_name";

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

absl::StatusOr<std::unique_ptr<losshead::client::Client>> losshead::cli::ConnectFromFlags(
    bool dedicated_connection) {
  client::ClientOptions options;
  options.max_message_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_message_bytes));
  options.deadline = absl::Seconds(absl::GetFlag(FLAGS_deadline_s));
  options.dedicated_connection = dedicated_connection;
  options.tls_root_ca_file = absl::GetFlag(FLAGS_tls_ca);
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

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "%s\n", kUsage);
    return 2;
  }
  const std::string command = args[1];
  // Like a trainer through the C API: gRPC's message buffers stay mapped between messages.
  losshead::transport::KeepTransferBuffersMapped();
  if (command == "demo") return losshead::cli::RunDemo();
  if (command == "bench") return losshead::cli::RunBench();
  if (command == "create") return losshead::cli::RunCreate();
  if (command == "list") return losshead::cli::RunList();
  if (command == "delete") return losshead::cli::RunDelete();
  if (command == "stats") return losshead::cli::RunStats();
  if (command == "health") return losshead::cli::RunHealth();
  if (command == "export") return losshead::cli::RunExport();
  if (command == "progress") return losshead::cli::RunProgress();
  if (command == "import") return losshead::cli::RunImport();
  std::fprintf(stderr, "unknown command '%s'\n%s\n", command.c_str(), kUsage);
  return 2;
}
