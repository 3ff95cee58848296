// The `losshead` command line against the flags registered in the binary: every flag belongs to
// a subcommand, --help lists exactly a subcommand's flags, a flag of another subcommand or of
// nobody is refused, deprecated spellings land on their flag, and --shards means what the Python
// client and the proto mean.
#include "client/cli/command_line.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "gtest/gtest.h"

namespace losshead::cli {
namespace {

// Every flag registered from client/cli/flags.cc: the registry's, not a list kept here.
std::set<std::string> RegisteredToolFlags() {
  std::set<std::string> names;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::EndsWith(flag->Filename(), "client/cli/flags.cc")) names.emplace(name);
  }
  return names;
}

std::set<std::string> DeprecatedNames() {
  std::set<std::string> names;
  for (const DeprecatedFlag& d : DeprecatedFlags()) names.emplace(d.old_name);
  return names;
}

// The flags a help text describes: its lines "  --name (default ...)".
std::set<std::string> DescribedFlags(const std::string& help) {
  std::set<std::string> names;
  for (absl::string_view line : absl::StrSplit(help, '\n')) {
    if (!absl::ConsumePrefix(&line, "  --")) continue;
    const size_t end = line.find(" (default ");
    if (end != absl::string_view::npos) names.emplace(line.substr(0, end));
  }
  return names;
}

std::set<std::string> FlagSetOf(const Command& command) {
  std::set<std::string> names;
  for (absl::string_view name : FlagsOf(command)) names.emplace(name);
  return names;
}

// Sets a flag as the command line would, by name (the deprecated spellings are declared nowhere:
// nothing reads them but the command line).
void Set(absl::string_view name, absl::string_view value) {
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  ASSERT_NE(flag, nullptr) << name;
  std::string error;
  ASSERT_TRUE(flag->ParseFrom(value, &error)) << name << ": " << error;
}

// argv of `losshead args...`.
class Argv {
 public:
  explicit Argv(std::vector<std::string> args) : args_(std::move(args)) {
    args_.insert(args_.begin(), "losshead");
    for (std::string& a : args_) pointers_.push_back(a.data());
  }
  int argc() const { return static_cast<int>(pointers_.size()); }
  char** argv() { return pointers_.data(); }

 private:
  std::vector<std::string> args_;
  std::vector<char*> pointers_;
};

absl::StatusOr<Invocation> Scan(std::vector<std::string> args) {
  Argv argv(std::move(args));
  return ScanCommandLine(argv.argc(), argv.argv());
}

TEST(CommandLine, EveryRegisteredFlagIsReadBySomeCommandOrIsADeprecatedSpelling) {
  std::set<std::string> read = DeprecatedNames();
  for (const Command& c : Commands()) {
    for (absl::string_view name : FlagsOf(c)) {
      EXPECT_NE(absl::FindCommandLineFlag(name), nullptr) << c.name << " reads no flag --" << name;
      read.emplace(name);
    }
  }
  EXPECT_EQ(read, RegisteredToolFlags());
}

TEST(CommandLine, ToolHelpDescribesEveryRegisteredFlag) {
  const std::set<std::string> described = DescribedFlags(HelpText(nullptr));
  const std::string help = HelpText(nullptr);
  for (const std::string& name : RegisteredToolFlags()) {
    if (DeprecatedNames().count(name) > 0) {
      EXPECT_TRUE(absl::StrContains(help, "  --" + name + ": --")) << name;
    } else {
      EXPECT_EQ(described.count(name), 1u) << "losshead --help does not describe --" << name;
    }
  }
  for (const Command& c : Commands()) {
    EXPECT_TRUE(absl::StrContains(help, "\n  " + std::string(c.name) + " ")) << c.name;
  }
}

TEST(CommandLine, CommandHelpDescribesExactlyItsFlagsWithTheirMeaning) {
  const std::set<std::string> registered = RegisteredToolFlags();
  for (const Command& c : Commands()) {
    const std::string help = HelpText(&c);
    // The flags the registry has that this command reads: everything registered, less what
    // the command refuses.
    std::set<std::string> expected;
    for (const std::string& name : registered) {
      if (DeprecatedNames().count(name) == 0 &&
          Scan({std::string(c.name), "--" + name + "=x"})
                  .status()
                  .message()
                  .find("is not a flag of") == absl::string_view::npos) {
        expected.insert(name);
      }
    }
    EXPECT_EQ(DescribedFlags(help), expected) << c.name;
    EXPECT_EQ(DescribedFlags(help), FlagSetOf(c)) << c.name;
    for (absl::string_view name : FlagsOf(c)) {
      const std::string meaning = absl::FindCommandLineFlag(name)->Help();
      const std::string first_word = std::string(meaning.substr(0, meaning.find(' ')));
      const size_t at = help.find("  --" + std::string(name) + " (default ");
      ASSERT_NE(at, std::string::npos);
      EXPECT_EQ(help.substr(help.find('\n', at) + 1, 6 + first_word.size()), "      " + first_word)
          << c.name << " --" << name;
    }
  }
}

TEST(CommandLine, CommandDefaultsOfSizesParseAndShowInHelp) {
  for (const Command& c : Commands()) {
    for (const FlagUse& f : c.flags) {
      if (f.default_value.empty()) continue;
      EXPECT_EQ(absl::FindCommandLineFlag(f.name)->DefaultValue(), "") << f.name;
      EXPECT_TRUE(absl::StrContains(
          HelpText(&c), absl::StrCat("  --", f.name, " (default ", f.default_value, ")\n")));
    }
  }
  EXPECT_EQ(SizeFlag(FLAGS_vocab_size, "bench"), 8192);
  EXPECT_EQ(SizeFlag(FLAGS_vocab_size, "demo"), 512);
  EXPECT_EQ(SizeFlag(FLAGS_hidden_size, "create"), 64);
  EXPECT_EQ(SizeFlag(FLAGS_chunk_tokens, "bench"), 1024);
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_vocab_size, 77);
  EXPECT_EQ(SizeFlag(FLAGS_vocab_size, "bench"), 77);
}

TEST(CommandLine, FindsTheCommandAndHelpAnywhere) {
  absl::StatusOr<Invocation> i = Scan({"--server", "h:1", "bench", "--vocab_size=3", "--help"});
  ASSERT_TRUE(i.ok()) << i.status();
  EXPECT_EQ(i->command, FindCommand("bench"));
  EXPECT_TRUE(i->help);
  i = Scan({"--help"});
  ASSERT_TRUE(i.ok()) << i.status();
  EXPECT_EQ(i->command, nullptr);
  EXPECT_TRUE(i->help);
  i = Scan({"bench", "--nozero_head", "--", "--not-a-flag-after-dashes"});
  EXPECT_EQ(i.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(i.status().message(), "unexpected argument")) << i.status();
  i = Scan({"create", "--flagfile=/dev/null", "--head", "x"});
  EXPECT_TRUE(i.ok()) << i.status();  // absl's own flags pass
}

TEST(CommandLine, RefusesAFlagOfAnotherCommandNamingItsFlags) {
  absl::StatusOr<Invocation> i = Scan({"create", "--streams=3"});
  EXPECT_EQ(i.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      i.status().message(),
      "--streams is not a flag of `losshead create` (a flag of bench); `losshead create` "
      "takes --head, --vocab_size, --hidden_size, --weight_dtype, --matmul_precision, "
      "--init_std, --seed, --replicas, --shards, --across_processes, --bias, --server, "
      "--max_message_bytes, --deadline_s, --token_file, --tls_root_ca, --tls_cert, --tls_key, "
      "--tls_server_name (losshead create --help)");
  // In every form absl accepts.
  EXPECT_FALSE(Scan({"list", "--head", "x"}).ok());
  EXPECT_FALSE(Scan({"list", "-head=x"}).ok());
  EXPECT_FALSE(Scan({"health", "--nozero_head"}).ok());
  EXPECT_FALSE(Scan({"export", "--server=h:1"}).ok());  // export reads a file, no server
  EXPECT_FALSE(Scan({"delete", "--v=3"}).ok());         // a deprecated spelling is its flag's
}

TEST(CommandLine, RefusesAnUnknownFlagOrCommand) {
  absl::StatusOr<Invocation> i = Scan({"stats", "--bogus=1"});
  EXPECT_EQ(i.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(i.status().message(),
            "unknown flag --bogus; `losshead stats` takes --server, --max_message_bytes, "
            "--deadline_s, --token_file, --tls_root_ca, --tls_cert, --tls_key, --tls_server_name "
            "(losshead stats --help)");
  EXPECT_EQ(Scan({"frob"}).status().message(),
            "unknown command 'frob' (losshead --help lists them)");
  EXPECT_EQ(Scan({}).status().message(), "no command given (losshead --help lists them)");
}

TEST(CommandLine, DeprecatedSpellingsLandOnTheirFlag) {
  absl::FlagSaver saver;
  Set("v", "300");
  Set("d", "20");
  Set("n", "10");
  Set("pipeline", "5");
  Set("dtype", "fp32");
  ASSERT_TRUE(FinishCommandLine(*FindCommand("bench")).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_vocab_size), 300);
  EXPECT_EQ(absl::GetFlag(FLAGS_hidden_size), 20);
  EXPECT_EQ(absl::GetFlag(FLAGS_chunk_tokens), 10);
  EXPECT_EQ(absl::GetFlag(FLAGS_depth), 5);
  EXPECT_EQ(absl::GetFlag(FLAGS_weight_dtype), "fp32");
}

TEST(CommandLine, RefusesASpellingAndItsFlagTogether) {
  absl::FlagSaver saver;
  Set("vocab", "300");
  absl::SetFlag(&FLAGS_vocab_size, 400);
  const absl::Status s = FinishCommandLine(*FindCommand("create"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "--vocab and --vocab_size both given; --vocab is a deprecated spelling of "
            "--vocab_size");
  EXPECT_EQ(absl::GetFlag(FLAGS_vocab_size), 400);
}

TEST(CommandLine, RefusesAForeignFlagSetOutsideArgv) {
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_init_std, 0.5);  // as from a --flagfile
  const absl::Status s = FinishCommandLine(*FindCommand("bench"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(s.message(), "--init_std is not a flag of `losshead bench`")) << s;
}

TEST(Placement, ShardsMeansWhatClientCreateHeadAndTheProtoMean) {
  absl::FlagSaver saver;
  absl::StatusOr<v1::Placement> p = PlacementFromFlags();  // unset: one device
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->kind(), v1::PLACEMENT_UNSPECIFIED);
  for (const auto& [shards, devices] : std::vector<std::pair<int, uint32_t>>{
           {0, 0}, {-1, 0}, {1, 1}, {3, 3}}) {  // 0 and the deprecated -1: every device
    absl::SetFlag(&FLAGS_shards, shards);
    p = PlacementFromFlags();
    ASSERT_TRUE(p.ok()) << shards;
    EXPECT_EQ(p->kind(), v1::PLACEMENT_SHARDED) << shards;
    EXPECT_EQ(p->devices(), devices) << shards;
  }
  absl::SetFlag(&FLAGS_shards, -2);
  EXPECT_EQ(PlacementFromFlags().status().message(),
            "--shards must be >= 0 (0: every device; unset: not sharded), got -2");
  absl::SetFlag(&FLAGS_shards, 0);
  absl::SetFlag(&FLAGS_replicas, 2);
  EXPECT_EQ(PlacementFromFlags().status().message(),
            "--shards and --replicas cannot both be given");
}

TEST(Placement, AcrossProcessesShardsOverEveryProcessOfAGroup) {
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_across_processes, true);
  EXPECT_EQ(PlacementFromFlags().status().message(), "--across_processes needs --shards");
  absl::SetFlag(&FLAGS_shards, 2);
  absl::StatusOr<v1::Placement> p = PlacementFromFlags();
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->kind(), v1::PLACEMENT_SHARDED);
  EXPECT_EQ(p->devices(), 2u);
  EXPECT_TRUE(p->across_processes());
}

}  // namespace
}  // namespace losshead::cli
