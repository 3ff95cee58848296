// A losshead-server child process on a loopback port, for tests that kill and restart it.
#ifndef LOSSHEAD_TESTS_COMMON_SERVER_PROCESS_H_
#define LOSSHEAD_TESTS_COMMON_SERVER_PROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace losshead::testing {

// How to spawn the process beyond its flags.
struct SpawnOptions {
  // When not 0: the child's RLIMIT_NOFILE, soft and hard (so the server cannot raise it).
  uint64_t open_files_limit = 0;
};

class ServerProcess {
 public:
  // Spawns `binary` with `flags` (after --listen=127.0.0.1:0 and no metrics endpoint, which flags
  // may override), stdout and stderr appended to `log_path`, and waits until it logs its port. If
  // the process exits first, FAILED_PRECONDITION carrying its exit code and log.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(const std::string& binary,
                                                              const std::vector<std::string>& flags,
                                                              const std::string& log_path,
                                                              const SpawnOptions& spawn = {});
  // Runs `binary` with `flags` expecting it to exit by itself within `timeout` (a server that
  // refuses to start); returns its exit code (DEADLINE_EXCEEDED, after killing it, otherwise).
  static absl::StatusOr<int> RunToExit(const std::string& binary,
                                       const std::vector<std::string>& flags,
                                       const std::string& log_path, absl::Duration timeout);
  ~ServerProcess();  // kills it if still running

  int port() const { return port_; }
  std::string target() const;
  pid_t pid() const { return pid_; }
  // Sends `signal` (SIGHUP, ...) and returns at once.
  void Signal(int signal);
  // SIGKILL, then reaps it.
  void Kill();
  // SIGTERM, then waits for the exit; returns the exit code (-signal if killed by one).
  int Terminate();
  // True while the process has not exited.
  bool Running();
  // Waits up to `timeout` for the process to exit by itself; its exit code (-signal if killed by
  // one), or nullopt if it still runs.
  std::optional<int> WaitForExit(absl::Duration timeout);

 private:
  ServerProcess(pid_t pid, int port) : pid_(pid), port_(port) {}
  pid_t pid_;
  int port_;
  bool reaped_ = false;
};

// The whole of a text file ("" if unreadable).
std::string ReadText(const std::string& path);

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_COMMON_SERVER_PROCESS_H_
