// Plain POSIX TCP for the process group: addresses, a listening socket, a connect and whole reads
// and writes, each bounded by a deadline. Every socket here is non-blocking, so that no call waits
// past its deadline; waiting is poll(2)'s.
#ifndef LOSSHEAD_KERNELS_COLLECTIVE_TCP_H_
#define LOSSHEAD_KERNELS_COLLECTIVE_TCP_H_

#include <cstddef>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace losshead::kernels::tcp {

// "host:port", "[v6addr]:port" or ":port" (host empty). INVALID_ARGUMENT for anything else, or a
// port outside [1, 65535].
struct HostPort {
  std::string host;
  std::string port;
};
absl::StatusOr<HostPort> ParseHostPort(absl::string_view address);

// An owned file descriptor, closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { Close(); }
  Fd(Fd&& other) noexcept : fd_(other.Release()) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void Close();

 private:
  int fd_ = -1;
};

// A listening socket on `at` (an empty host: every address), with SO_REUSEADDR so that a process
// rebuilt on the same port does not wait out TIME_WAIT. UNAVAILABLE when the address is taken or
// cannot be bound.
absl::StatusOr<Fd> Listen(const HostPort& at);

// One attempt to connect to `to` by `deadline`: resolves the name (a StatefulSet peer's name does
// not resolve before its pod exists) and tries each address. UNAVAILABLE with the reason when no
// address takes the connection; DEADLINE_EXCEEDED when the deadline passes first.
absl::StatusOr<Fd> Connect(const HostPort& to, absl::Time deadline);

// A connection accepted on `listener` by `deadline`; DEADLINE_EXCEEDED when none comes.
absl::StatusOr<Fd> Accept(const Fd& listener, absl::Time deadline);

// All of `bytes` written or read by `deadline`. UNAVAILABLE on the peer's close or an I/O error,
// DEADLINE_EXCEEDED on the deadline.
absl::Status WriteAll(const Fd& fd, std::span<const std::byte> bytes, absl::Time deadline);
absl::Status ReadAll(const Fd& fd, std::span<std::byte> bytes, absl::Time deadline);

// Milliseconds from now to `deadline` for poll(2): 0 when past, capped so that it fits an int.
int PollMillis(absl::Time deadline);

// strerror(errno) as a string, thread-safe.
std::string ErrnoText(int err);

}  // namespace losshead::kernels::tcp

#endif  // LOSSHEAD_KERNELS_COLLECTIVE_TCP_H_
