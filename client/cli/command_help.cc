// `losshead --help` and `losshead <command> --help`.
#include <algorithm>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/cli/command_line.h"

namespace losshead::cli {
namespace {

constexpr size_t kWidth = 100;
// A deprecated value rather than a spelling (PlacementFromFlags).
constexpr absl::string_view kDeprecatedShards = "shards=-1: --shards=0";

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
                      Wrap(absl::StrCat("(", CommandsReading(f.name), ")"), 6));
    }
  }
  absl::StrAppend(&out, "\ndeprecated spellings, accepted wherever the new name is:\n");
  for (const DeprecatedFlag& d : DeprecatedFlags()) {
    absl::StrAppend(&out, "  --", d.old_name, ": --", d.name, "\n");
  }
  absl::StrAppend(&out, "  --", kDeprecatedShards, "\n");
  return out;
}

}  // namespace

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
  std::string deprecated;
  for (const DeprecatedFlag& d : DeprecatedFlags()) {
    if (ReadsFlag(*command, d.name))
      absl::StrAppend(&deprecated, "  --", d.old_name, ": --", d.name, "\n");
  }
  if (ReadsFlag(*command, "shards")) absl::StrAppend(&deprecated, "  --", kDeprecatedShards, "\n");
  if (!deprecated.empty()) {
    absl::StrAppend(&out, "\ndeprecated spellings (still accepted):\n", deprecated);
  }
  return out;
}

}  // namespace losshead::cli
