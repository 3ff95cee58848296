#include "tests/common/server_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace losshead::testing {
namespace {

constexpr char kServingLine[] = "serving gRPC on ";

// fork + exec with the child's descriptor limit set in between (posix_spawn cannot set one). The
// child calls only async-signal-safe functions before exec.
absl::StatusOr<pid_t> ForkWithLimit(const std::string& binary, const std::vector<char*>& argv,
                                    const std::string& log_path, uint64_t open_files_limit) {
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    const rlimit limit{.rlim_cur = open_files_limit, .rlim_max = open_files_limit};
    const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0 || log < 0 || dup2(log, STDOUT_FILENO) < 0 ||
        dup2(log, STDERR_FILENO) < 0) {
      _exit(127);
    }
    execve(binary.c_str(), argv.data(), environ);
    _exit(127);
  }
  return pid;
}

absl::StatusOr<pid_t> Spawn(const std::string& binary, const std::vector<std::string>& flags,
                            const std::string& log_path, const SpawnOptions& spawn = {}) {
  std::vector<std::string> args = {binary};
  args.insert(args.end(), flags.begin(), flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  if (spawn.open_files_limit != 0) {
    return ForkWithLimit(binary, argv, log_path, spawn.open_files_limit);
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid;
  const int rc = posix_spawn(&pid, binary.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("posix_spawn ", binary, ": ", std::strerror(rc)));
  }
  return pid;
}

int ExitCode(int wstatus) {
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) return -WTERMSIG(wstatus);
  return -1000;
}

}  // namespace

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const std::string& binary, const std::vector<std::string>& flags, const std::string& log_path,
    const SpawnOptions& spawn) {
  // Earlier runs may have logged to the same file: look for the port after its current end.
  const size_t offset = ReadText(log_path).size();
  std::vector<std::string> all = {"--listen=127.0.0.1:0", "--metrics_listen="};
  all.insert(all.end(), flags.begin(), flags.end());
  absl::StatusOr<pid_t> pid = Spawn(binary, all, log_path, spawn);
  if (!pid.ok()) return pid.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    const std::string log = ReadText(log_path);
    const size_t at = log.find(kServingLine, offset);
    const size_t eol = at == std::string::npos ? at : log.find('\n', at);
    if (eol != std::string::npos) {
      const std::string line = log.substr(at, eol - at);
      const size_t colon = line.find(':');
      const size_t comma = line.find(',', colon);
      int port = 0;
      if (colon != std::string::npos && comma != std::string::npos &&
          absl::SimpleAtoi(line.substr(colon + 1, comma - colon - 1), &port) && port > 0) {
        return std::unique_ptr<ServerProcess>(new ServerProcess(*pid, port));
      }
      return absl::InternalError(absl::StrCat("cannot parse the port from: ", line));
    }
    int wstatus;
    if (waitpid(*pid, &wstatus, WNOHANG) == *pid) {
      return absl::FailedPreconditionError(absl::StrCat(
          "server exited with ", ExitCode(wstatus), " before serving; log:\n", log.substr(offset)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  kill(*pid, SIGKILL);
  waitpid(*pid, nullptr, 0);
  return absl::DeadlineExceededError("server did not start serving within 60 s");
}

absl::StatusOr<int> ServerProcess::RunToExit(const std::string& binary,
                                             const std::vector<std::string>& flags,
                                             const std::string& log_path, absl::Duration timeout) {
  std::vector<std::string> all = {"--listen=127.0.0.1:0", "--metrics_listen="};
  all.insert(all.end(), flags.begin(), flags.end());
  absl::StatusOr<pid_t> pid = Spawn(binary, all, log_path);
  if (!pid.ok()) return pid.status();
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int wstatus;
    if (waitpid(*pid, &wstatus, WNOHANG) == *pid) return ExitCode(wstatus);
    absl::SleepFor(absl::Milliseconds(10));
  }
  kill(*pid, SIGKILL);
  waitpid(*pid, nullptr, 0);
  return absl::DeadlineExceededError("the server kept running");
}

ServerProcess::~ServerProcess() {
  if (!reaped_) Kill();
}

std::string ServerProcess::target() const { return absl::StrCat("127.0.0.1:", port_); }

void ServerProcess::Signal(int signal) {
  if (!reaped_) kill(pid_, signal);
}

void ServerProcess::Kill() {
  if (reaped_) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  reaped_ = true;
}

int ServerProcess::Terminate() {
  if (reaped_) return -1000;
  kill(pid_, SIGTERM);
  int wstatus = 0;
  waitpid(pid_, &wstatus, 0);
  reaped_ = true;
  return ExitCode(wstatus);
}

std::optional<int> ServerProcess::WaitForExit(absl::Duration timeout) {
  if (reaped_) return std::nullopt;
  const absl::Time until = absl::Now() + timeout;
  while (true) {
    int wstatus = 0;
    if (waitpid(pid_, &wstatus, WNOHANG) == pid_) {
      reaped_ = true;
      return ExitCode(wstatus);
    }
    if (absl::Now() >= until) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(50));
  }
}

bool ServerProcess::Running() {
  if (reaped_) return false;
  int wstatus;
  if (waitpid(pid_, &wstatus, WNOHANG) == pid_) {
    reaped_ = true;
    return false;
  }
  return true;
}

}  // namespace losshead::testing
