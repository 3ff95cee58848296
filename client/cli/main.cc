// losshead: command-line client of losshead-server.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"

namespace {

constexpr char kUsage[] =
    "losshead <command> [flags]\n"
    "commands:\n"
    "  demo    train a head end to end: a student learns a random teacher's distribution\n"
    "  bench   stream synthetic bf16 micro-batches and report tokens/s and step latency\n"
    "  create  create a head (--head, --vocab, --hidden, --dtype, --init_std, --seed)\n"
    "  list    list heads\n"
    "  delete  delete a head (--head)\n"
    "  stats   print the server's stats\n"
    "  health  exit 0 when the server is SERVING\n"
    "common flags: --server, --max_message_bytes, --deadline_s";

}  // namespace

absl::StatusOr<std::unique_ptr<losshead::client::Client>> losshead::cli::ConnectFromFlags(
    bool dedicated_connection) {
  client::ClientOptions options;
  options.max_message_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_message_bytes));
  options.deadline = absl::Seconds(absl::GetFlag(FLAGS_deadline_s));
  options.dedicated_connection = dedicated_connection;
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
  if (command == "demo") return losshead::cli::RunDemo();
  if (command == "bench") return losshead::cli::RunBench();
  if (command == "create") return losshead::cli::RunCreate();
  if (command == "list") return losshead::cli::RunList();
  if (command == "delete") return losshead::cli::RunDelete();
  if (command == "stats") return losshead::cli::RunStats();
  if (command == "health") return losshead::cli::RunHealth();
  std::fprintf(stderr, "unknown command '%s'\n%s\n", command.c_str(), kUsage);
  return 2;
}
