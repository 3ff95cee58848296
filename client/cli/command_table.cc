// The subcommands of `losshead` and the flags each reads.
#include <algorithm>

#include "absl/flags/commandlineflag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "client/cli/command_line.h"
#include "client/cli/commands.h"

namespace losshead::cli {
namespace {

const DeprecatedFlag* FindDeprecated(absl::string_view old_name) {
  for (const DeprecatedFlag& d : DeprecatedFlags()) {
    if (d.old_name == old_name) return &d;
  }
  return nullptr;
}

}  // namespace

const std::vector<Command>& Commands() {
  static const auto* const kCommands = new std::vector<Command>{
      {.name = "demo",
       .summary = "train a head end to end: a student learns a random teacher's distribution",
       .flags = {{"head"},
                 {"seed"},
                 {"vocab_size", "512"},
                 {"hidden_size", "64"},
                 {"steps"},
                 {"tokens_per_step"},
                 {"chunk_tokens", "512"},
                 {"lr"},
                 {"optimizer"},
                 {"client_optimizer"},
                 {"teacher_gain"},
                 {"print_every"},
                 {"keep_head"}},
       .run = RunDemo},
      {.name = "bench",
       .summary = "stream synthetic micro-batches (bf16 hidden states) through a head; report "
                  "tokens/s and step latency",
       .flags = {{"head"},
                 {"seed"},
                 {"vocab_size", "8192"},
                 {"hidden_size", "512"},
                 {"weight_dtype"},
                 {"matmul_precision"},
                 {"replicas"},
                 {"shards"},
                 {"across_processes"},
                 {"chunk_tokens", "1024"},
                 {"streams"},
                 {"depth"},
                 {"seconds"},
                 {"iterations"},
                 {"dedicated_connections"},
                 {"same_node"},
                 {"fresh_results"},
                 {"zero_head"},
                 {"keep_head"}},
       .run = RunBench},
      {.name = "create",
       .summary = "create a head",
       .flags = {{"head"},
                 {"vocab_size", "512"},
                 {"hidden_size", "64"},
                 {"weight_dtype"},
                 {"matmul_precision"},
                 {"init_std"},
                 {"seed"},
                 {"replicas"},
                 {"shards"},
                 {"across_processes"},
                 {"bias"}},
       .run = RunCreate},
      {.name = "list", .summary = "list heads", .run = RunList},
      {.name = "delete", .summary = "delete a head", .flags = {{"head"}}, .run = RunDelete},
      {.name = "stats", .summary = "print the server's stats", .run = RunStats},
      {.name = "health", .summary = "exit 0 when the server is SERVING", .run = RunHealth},
      {.name = "progress",
       .summary = "acknowledged and persisted sequence of --client_id on --head (what a crash "
                  "lost: every sequence above persisted)",
       .flags = {{"head"}, {"client_id"}},
       .run = RunProgress},
      {.name = "export",
       .summary = "a server checkpoint file to safetensors + a manifest, offline (no server)",
       .flags = {{"checkpoint"},
                 {"head"},
                 {"tag"},
                 {"out"},
                 {"manifest"},
                 {"tensor"},
                 {"with_optimizer"},
                 {"with_gradient"}},
       .connects = false,
       .run = RunExport},
      {.name = "import",
       .summary = "create --head from a safetensors tensor and push it as W",
       .flags = {{"safetensors"},
                 {"tensor"},
                 {"head"},
                 {"create"},
                 {"matmul_precision"},
                 {"replicas"},
                 {"shards"},
                 {"across_processes"}},
       .run = RunImport},
  };
  return *kCommands;
}

const Command* FindCommand(absl::string_view name) {
  for (const Command& c : Commands()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

const std::vector<absl::string_view>& ConnectionFlags() {
  static const auto* const kFlags = new std::vector<absl::string_view>{
      "server",      "max_message_bytes", "deadline_s", "token_file",
      "tls_root_ca", "tls_cert",          "tls_key",    "tls_server_name"};
  return *kFlags;
}

const std::vector<DeprecatedFlag>& DeprecatedFlags() {
  static const auto* const kFlags = new std::vector<DeprecatedFlag>{
      {"vocab", "vocab_size"}, {"v", "vocab_size"},       {"hidden", "hidden_size"},
      {"d", "hidden_size"},    {"n", "chunk_tokens"},     {"microbatch", "chunk_tokens"},
      {"pipeline", "depth"},   {"dtype", "weight_dtype"}, {"tls_ca", "tls_root_ca"},
  };
  return *kFlags;
}

std::vector<absl::string_view> FlagsOf(const Command& command) {
  std::vector<absl::string_view> flags;
  for (const FlagUse& f : command.flags) flags.push_back(f.name);
  if (command.connects) {
    flags.insert(flags.end(), ConnectionFlags().begin(), ConnectionFlags().end());
  }
  return flags;
}

bool ReadsFlag(const Command& command, absl::string_view name) {
  if (const DeprecatedFlag* d = FindDeprecated(name)) name = d->name;
  const std::vector<absl::string_view> flags = FlagsOf(command);
  return std::find(flags.begin(), flags.end(), name) != flags.end();
}

std::string CommandsReading(absl::string_view name) {
  std::vector<absl::string_view> readers;
  for (const Command& c : Commands()) {
    if (ReadsFlag(c, name)) readers.push_back(c.name);
  }
  return absl::StrJoin(readers, ", ");
}

int64_t SizeFlag(const absl::Flag<std::optional<int64_t>>& flag, absl::string_view command) {
  if (const std::optional<int64_t> value = absl::GetFlag(flag); value.has_value()) return *value;
  const absl::string_view name = absl::GetFlagReflectionHandle(flag).Name();
  int64_t value = 0;
  if (const Command* c = FindCommand(command)) {
    for (const FlagUse& f : c->flags) {
      if (f.name == name && absl::SimpleAtoi(f.default_value, &value)) return value;
    }
  }
  return 0;  // no default in the table: refused by the command's range check
}

}  // namespace losshead::cli
