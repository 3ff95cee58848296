// Reading the command line of `losshead`: the command, --help, and the flags it may take.
#include "client/cli/command_line.h"

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace losshead::cli {
namespace {

// Where every flag of the tool is defined; absl's own (--flagfile, ...) live elsewhere.
constexpr absl::string_view kFlagsFile = "client/cli/flags.cc";

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

std::string FlagList(const Command& command) {
  const std::vector<absl::string_view> flags = FlagsOf(command);
  if (flags.empty()) return absl::StrCat("`losshead ", command.name, "` takes no flags");
  return absl::StrCat("`losshead ", command.name, "` takes --", absl::StrJoin(flags, ", --"));
}

}  // namespace

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
    if (ReadsFlag(command, name)) continue;
    const std::string readers = CommandsReading(name);
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " is not a flag of `losshead ", command.name, "`",
                     readers.empty() ? "" : absl::StrCat(" (a flag of ", readers, ")"), "; ",
                     FlagList(command), " (losshead ", command.name, " --help)"));
  }
  return invocation;
}

absl::Status FinishCommandLine(const Command& command) {
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!IsToolFlag(*flag) || ReadsFlag(command, name)) continue;
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
