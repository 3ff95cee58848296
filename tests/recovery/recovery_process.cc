#include "tests/recovery/recovery_process.h"

#include <stdlib.h>

#include <filesystem>
#include <utility>

#include "absl/time/time.h"

namespace losshead::testing {

std::string RecoveryTempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "losshead-recovery-XXXXXX");
  char* dir = mkdtemp(pattern.data());
  return dir == nullptr ? "" : std::string(dir);
}

std::unique_ptr<client::Client> ConnectToServer(const ServerProcess& process) {
  client::ClientOptions options;
  options.deadline = absl::Seconds(30);
  options.stream_deadline = absl::Seconds(120);
  auto c = client::Client::Connect(process.target(), options);
  return c.ok() ? std::move(*c) : nullptr;
}

}  // namespace losshead::testing
