// Command-line flags of losshead-server and their mapping onto ServerOptions.
#ifndef LOSSHEAD_SERVER_FLAGS_H_
#define LOSSHEAD_SERVER_FLAGS_H_

#include "absl/status/statusor.h"
#include "server/server.h"

namespace losshead::server {

// Makes --help and --helpshort list the flags of this file (absl's default matches only flags
// defined in the file of main()), named by their path from the repository root. Call before
// absl::ParseCommandLine.
void ConfigureFlagsUsage();

// ServerOptions from the parsed flags; INVALID_ARGUMENT for a bad --backend or a limit of 0.
absl::StatusOr<ServerOptions> OptionsFromFlags();

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_FLAGS_H_
