#include "client/cli/command_line.h"

#include <algorithm>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"

namespace losshead::cli {
namespace {

// Where every flag of the tool is defined; absl's own (--flagfile, ...) live elsewhere.
constexpr absl::string_view kFlagsFile = "client/cli/flags.cc";
constexpr size_t kWidth = 100;

bool IsToolFlag(const absl::CommandLineFlag& flag) {
  return absl::EndsWith(flag.Filename(), kFlagsFile);
}

// absl's usage flags other than --help and --helpshort, which the tool answers itself.
bool IsAbslUsageFlag(absl::string_view name) {
  for (absl::string_view usage :
       {"helpfull", "helppackage", "helpon", "helpmatch", "version", "only_check_args"}) {
    if (name == usage) return true;
  }
  return false;
}

// absl's flags of the parser itself, registered where absl::ParseCommandLine is linked; each takes
// a value.
bool IsAbslParseFlag(absl::string_view name) {
  return name == "flagfile" || name == "fromenv" || name == "tryfromenv" || name == "undefok";
}

const DeprecatedFlag* FindDeprecated(absl::string_view old_name) {
  for (const DeprecatedFlag& d : DeprecatedFlags()) {
    if (d.old_name == old_name) return &d;
  }
  return nullptr;
}

bool Reads(const Command& command, absl::string_view name) {
  if (const DeprecatedFlag* d = FindDeprecated(name)) name = d->name;
  const std::vector<absl::string_view> flags = FlagsOf(command);
  return std::find(flags.begin(), flags.end(), name) != flags.end();
}

// The commands that read `name`, for the error that refuses it elsewhere.
std::string ReadersOf(absl::string_view name) {
  std::vector<absl::string_view> readers;
  for (const Command& c : Commands()) {
    if (Reads(c, name)) readers.push_back(c.name);
  }
  return absl::StrJoin(readers, ", ");
}

std::string FlagList(const Command& command) {
  const std::vector<absl::string_view> flags = FlagsOf(command);
  if (flags.empty()) return absl::StrCat("`losshead ", command.name, "` takes no flags");
  return absl::StrCat("`losshead ", command.name, "` takes --", absl::StrJoin(flags, ", --"));
}

// `text` after `first` on its first line, split into lines of at most kWidth columns, each after
// `indent` spaces but the first.
std::string Wrap(absl::string_view text, size_t indent, absl::string_view first = {}) {
  std::string out;
  std::string line = first.empty() ? std::string(indent, ' ') : std::string(first);
  bool has_words = false;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (has_words && line.size() + 1 + word.size() > kWidth) {
      absl::StrAppend(&out, line, "\n");
      line.assign(indent, ' ');
      has_words = false;
    }
    absl::StrAppend(&line, has_words ? " " : "", word);
    has_words = true;
  }
  return absl::StrCat(out, line, "\n");
}

std::string ShowDefault(absl::string_view value) {
  return value.empty() ? "none" : std::string(value);
}

// "  --name (default X)" and the flag's meaning below it. `default_text` overrides the
// registered default.
std::string DescribeFlag(absl::string_view name, absl::string_view default_text) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  if (flag == nullptr) return absl::StrCat("  --", name, "\n");  // a table error; the test says
  const std::string shown =
      default_text.empty() ? ShowDefault(flag->DefaultValue()) : std::string(default_text);
  return absl::StrCat("  --", name, " (default ", shown, ")\n", Wrap(flag->Help(), 6));
}

// Each command's own default for `name`, "demo 512, bench 8192"; empty where none has one.
std::string DefaultsAcrossCommands(absl::string_view name) {
  std::vector<std::string> defaults;
  for (const Command& c : Commands()) {
    for (const FlagUse& f : c.flags) {
      if (f.name == name && !f.default_value.empty()) {
        defaults.push_back(absl::StrCat(c.name, " ", f.default_value));
      }
    }
  }
  return absl::StrJoin(defaults, ", ");
}

std::string ToolHelp() {
  std::string out =
      "losshead: the command-line client of losshead-server\n\n"
      "usage: losshead <command> [flags]    (losshead <command> --help: its flags)\n\n"
      "commands:\n";
  for (const Command& c : Commands()) {
    const std::string first =
        absl::StrCat("  ", c.name, std::string(10 - std::min<size_t>(9, c.name.size()), ' '));
    absl::StrAppend(&out, Wrap(c.summary, first.size(), first));
  }
  absl::StrAppend(&out, "\nconnection flags (every command that talks to a server):\n");
  for (absl::string_view name : ConnectionFlags()) absl::StrAppend(&out, DescribeFlag(name, ""));
  absl::StrAppend(&out, "\nflags of the commands:\n");
  std::vector<absl::string_view> listed;
  for (const Command& c : Commands()) {
    for (const FlagUse& f : c.flags) {
      if (std::find(listed.begin(), listed.end(), f.name) != listed.end()) continue;
      listed.push_back(f.name);
      absl::StrAppend(&out, DescribeFlag(f.name, DefaultsAcrossCommands(f.name)),
                      Wrap(absl::StrCat("(", ReadersOf(f.name), ")"), 6));
    }
  }
  absl::StrAppend(&out, "\ndeprecated spellings, accepted wherever the new name is:\n");
  for (const DeprecatedFlag& d : DeprecatedFlags()) {
    absl::StrAppend(&out, "  --", d.old_name, ": --", d.name, "\n");
  }
  return out;
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
                 {"chunk_tokens", "1024"},
                 {"streams"},
                 {"depth"},
                 {"seconds"},
                 {"iterations"},
                 {"dedicated_connections"},
                 {"fresh_results"},
                 {"zero_head"}},
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
                 {"shards"}},
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
                 {"shards"}},
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
      "server", "max_message_bytes", "deadline_s", "token_file",
      "tls_ca", "tls_cert",          "tls_key",    "tls_server_name"};
  return *kFlags;
}

const std::vector<DeprecatedFlag>& DeprecatedFlags() {
  static const auto* const kFlags = new std::vector<DeprecatedFlag>{
      {"vocab", "vocab_size"}, {"v", "vocab_size"},       {"hidden", "hidden_size"},
      {"d", "hidden_size"},    {"n", "chunk_tokens"},     {"microbatch", "chunk_tokens"},
      {"pipeline", "depth"},   {"dtype", "weight_dtype"},
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

std::string HelpText(const Command* command) {
  if (command == nullptr) return ToolHelp();
  std::string out = absl::StrCat("losshead ", command->name, ": ", command->summary, "\n\n",
                                 "usage: losshead ", command->name, " [flags]\n\n");
  if (command->flags.empty()) {
    absl::StrAppend(&out, "flags: none of its own\n");
  } else {
    absl::StrAppend(&out, "flags:\n");
    for (const FlagUse& f : command->flags) {
      absl::StrAppend(&out, DescribeFlag(f.name, f.default_value));
    }
  }
  if (command->connects) {
    absl::StrAppend(&out, "\nconnection flags:\n");
    for (absl::string_view name : ConnectionFlags()) absl::StrAppend(&out, DescribeFlag(name, ""));
  }
  std::vector<std::string> deprecated;
  for (const DeprecatedFlag& d : DeprecatedFlags()) {
    if (Reads(*command, d.name))
      deprecated.push_back(absl::StrCat("--", d.old_name, ": --", d.name));
  }
  if (!deprecated.empty()) {
    absl::StrAppend(
        &out, "\ndeprecated spellings (still accepted): ", absl::StrJoin(deprecated, ", "), "\n");
  }
  return out;
}

absl::StatusOr<Invocation> ScanCommandLine(int argc, char** argv) {
  Invocation invocation;
  std::vector<absl::string_view> positional;
  std::vector<std::string> unknown;
  std::vector<std::string> given;  // the tool's flags on the command line, as written
  bool absl_usage = false;         // --helpfull, --version, ...: absl answers them
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") {
      for (++i; i < argc; ++i) positional.push_back(argv[i]);
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      positional.push_back(arg);
      continue;
    }
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    const bool has_value = absl::StrContains(arg, '=');
    absl::string_view name = arg.substr(0, arg.find('='));
    if (name == "help" || name == "helpshort") {
      invocation.help = true;
      continue;
    }
    if (IsAbslUsageFlag(name)) {
      absl_usage = true;
      continue;
    }
    if (IsAbslParseFlag(name)) {
      if (!has_value) ++i;  // `--flagfile FILE`
      continue;
    }
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    bool negated = false;
    if (flag == nullptr && !has_value && absl::ConsumePrefix(&name, "no")) {
      flag = absl::FindCommandLineFlag(name);  // --nofoo for a bool --foo
      negated = true;
    }
    if (flag == nullptr) {
      unknown.push_back(absl::StrCat("--", name));
      continue;
    }
    // `--flag value` for a flag that is not a bool: the next argument is its value.
    if (!has_value && !negated && !flag->IsOfType<bool>()) ++i;
    if (IsToolFlag(*flag)) given.emplace_back(name);
  }
  if (positional.empty()) {
    if ((invocation.help || absl_usage) && unknown.empty()) return invocation;
    return absl::InvalidArgumentError(
        absl::StrCat(unknown.empty() ? "" : absl::StrCat("unknown flag ", unknown[0], "; "),
                     "no command given (losshead --help lists them)"));
  }
  invocation.command = FindCommand(positional[0]);
  if (invocation.command == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown command '", positional[0], "' (losshead --help lists them)"));
  }
  const Command& command = *invocation.command;
  if (positional.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument '", positional[1], "': `losshead ", command.name,
                     "` takes one command and flags (losshead ", command.name, " --help)"));
  }
  if (!unknown.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown flag ", unknown[0], "; ",
                                                   FlagList(command), " (losshead ", command.name,
                                                   " --help)"));
  }
  for (const std::string& name : given) {
    if (Reads(command, name)) continue;
    const std::string readers = ReadersOf(name);
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " is not a flag of `losshead ", command.name, "`",
                     readers.empty() ? "" : absl::StrCat(" (a flag of ", readers, ")"), "; ",
                     FlagList(command), " (losshead ", command.name, " --help)"));
  }
  return invocation;
}

absl::Status FinishCommandLine(const Command& command) {
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!IsToolFlag(*flag) || Reads(command, name)) continue;
    if (flag->CurrentValue() != flag->DefaultValue()) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " is not a flag of `losshead ",
                                                     command.name, "`; ", FlagList(command),
                                                     " (losshead ", command.name, " --help)"));
    }
  }
  for (const DeprecatedFlag& d : DeprecatedFlags()) {
    absl::CommandLineFlag* old_flag = absl::FindCommandLineFlag(d.old_name);
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(d.name);
    if (old_flag == nullptr || flag == nullptr) {
      return absl::InternalError(absl::StrCat("no flag --", d.old_name, " or --", d.name));
    }
    if (old_flag->CurrentValue() == old_flag->DefaultValue()) continue;
    if (flag->CurrentValue() != flag->DefaultValue()) {
      return absl::InvalidArgumentError(absl::StrCat("--", d.old_name, " and --", d.name,
                                                     " both given; --", d.old_name,
                                                     " is a deprecated spelling of --", d.name));
    }
    std::string error;
    if (!flag->ParseFrom(old_flag->CurrentValue(), &error)) {
      return absl::InvalidArgumentError(absl::StrCat("--", d.old_name, ": ", error));
    }
  }
  return absl::OkStatus();
}

}  // namespace losshead::cli
