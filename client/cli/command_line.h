// The command line of the `losshead` tool: its subcommands, the flags each one reads, their
// --help, and the checks made before a subcommand runs.
//
// Invariants: every flag defined in client/cli/flags.cc is read by at least one subcommand or is
// a deprecated spelling of one that is (tests/cli/command_line_test.cc); a subcommand runs only
// with flags it reads (ScanCommandLine and FinishCommandLine refuse the others; the tool exits
// 2); --help of a subcommand lists exactly the flags it reads.
#ifndef LOSSHEAD_CLIENT_CLI_COMMAND_LINE_H_
#define LOSSHEAD_CLIENT_CLI_COMMAND_LINE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace losshead::cli {

// One of a subcommand's flags, and its default where the subcommand has its own (the flag's
// registered default is empty then: sizes whose sensible value differs between subcommands).
struct FlagUse {
  absl::string_view name;
  absl::string_view default_value = {};
};

struct Command {
  absl::string_view name;
  absl::string_view summary;   // one line
  std::vector<FlagUse> flags;  // its own, in the order --help lists them
  bool connects = true;        // reads the connection flags (--server, TLS, token, ...)
  int (*run)() = nullptr;
};

// An old spelling of a flag, accepted wherever the flag is and copied onto it.
struct DeprecatedFlag {
  absl::string_view old_name;
  absl::string_view name;
};

const std::vector<Command>& Commands();
const Command* FindCommand(absl::string_view name);
// --server, --max_message_bytes, --deadline_s, --token_file and the TLS flags.
const std::vector<absl::string_view>& ConnectionFlags();
const std::vector<DeprecatedFlag>& DeprecatedFlags();

// The names of the flags `command` reads: its own, then the connection flags if it connects.
std::vector<absl::string_view> FlagsOf(const Command& command);

// Whether `command` reads flag `name`, or the flag `name` is a deprecated spelling of.
bool ReadsFlag(const Command& command, absl::string_view name);

// The commands that read flag `name`: "demo, bench, create".
std::string CommandsReading(absl::string_view name);

// An optional size flag's value, or `command`'s default for it (its FlagUse::default_value).
int64_t SizeFlag(const absl::Flag<std::optional<int64_t>>& flag, absl::string_view command);

// `losshead <command> --help`: the command's line, then each of its flags with its default and
// meaning. Without a command: the tool's, every command and every flag.
std::string HelpText(const Command* command);

// What a command line asks for, read before the flags are parsed.
struct Invocation {
  const Command* command = nullptr;  // null with --help alone, or one of absl's --helpfull,
                                     // --version...: absl::ParseCommandLine answers those
  bool help = false;                 // --help or --helpshort: print HelpText, run nothing
};

// Reads argv: the command (the one argument that is not a flag or a flag's value) and --help.
// INVALID_ARGUMENT, naming what the command takes, for a flag no part of the tool defines, a flag
// of the tool that the command does not read, no command or an unknown one, or a second
// argument. absl's own flags (--flagfile, --helpfull, ...) pass.
absl::StatusOr<Invocation> ScanCommandLine(int argc, char** argv);

// After absl has parsed the flags: refuses a flag of the tool that `command` does not read but
// that holds other than its default all the same (set from a --flagfile), and copies each
// deprecated spelling that was given onto its flag (INVALID_ARGUMENT when both were given).
absl::Status FinishCommandLine(const Command& command);

}  // namespace losshead::cli

#endif  // LOSSHEAD_CLIENT_CLI_COMMAND_LINE_H_
