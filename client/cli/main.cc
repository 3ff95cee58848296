// losshead: command-line client of losshead-server.
#include <cstdio>
#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "client/cli/command_line.h"
#include "transport/heap_tuning.h"

int main(int argc, char** argv) {
  // Read before absl parses: absl would end the process with its own message (exit code 1) for a
  // flag it does not know, and would answer --help without the subcommands.
  const absl::StatusOr<losshead::cli::Invocation> invocation =
      losshead::cli::ScanCommandLine(argc, argv);
  if (!invocation.ok()) {
    std::fprintf(stderr, "losshead: %s\n", std::string(invocation.status().message()).c_str());
    return 2;
  }
  if (invocation->help) {
    std::fputs(losshead::cli::HelpText(invocation->command).c_str(), stdout);
    return 0;
  }
  absl::SetProgramUsageMessage("losshead <command> [flags]; losshead --help lists the commands");
  absl::ParseCommandLine(argc, argv);  // answers --helpfull, --version and the like itself
  if (invocation->command == nullptr) return 2;
  const losshead::cli::Command& command = *invocation->command;
  if (absl::Status s = losshead::cli::FinishCommandLine(command); !s.ok()) {
    std::fprintf(stderr, "losshead: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  // Like a trainer through the C API: gRPC's message buffers stay mapped between messages.
  losshead::transport::KeepTransferBuffersMapped();
  return command.run();
}
