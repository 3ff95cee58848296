// Unix sockets that carry a file descriptor with a message: the same-node path's control channel
// (docs/same-node.md). SOCK_SEQPACKET, so that each message arrives whole or not at all, and the
// descriptor travels in SCM_RIGHTS, so that the receiver gets its own reference to the sender's
// memory without any name another process could open.
#ifndef LOSSHEAD_TRANSPORT_FD_SOCKET_H_
#define LOSSHEAD_TRANSPORT_FD_SOCKET_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace losshead::transport {

// A descriptor closed when this goes out of scope (-1: none).
class OwnedFd {
 public:
  OwnedFd() = default;
  explicit OwnedFd(int fd) : fd_(fd) {}
  OwnedFd(OwnedFd&& other) noexcept : fd_(other.release()) {}
  OwnedFd& operator=(OwnedFd&& other) noexcept;
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  ~OwnedFd() { reset(); }

  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// A socket name: "@name" is `name` in the abstract namespace (no file; gone with the socket),
// anything else a path.
absl::StatusOr<OwnedFd> ListenSeqpacket(const std::string& name);
absl::StatusOr<OwnedFd> ConnectSeqpacket(const std::string& name);

// Sends `bytes` as one message, with `fd` in SCM_RIGHTS when it is >= 0.
absl::Status SendWithFd(int socket, absl::string_view bytes, int fd = -1);

// One received message: its bytes (at most the receiver's limit) and the descriptor it carried
// (none: -1). A message of more bytes than the limit, or with more than one descriptor, is
// INVALID_ARGUMENT (every descriptor it carried is closed). End of stream: `closed`.
struct FdMessage {
  std::string bytes;
  OwnedFd fd;
  bool closed = false;
};
// `nonblocking`: UNAVAILABLE when no message is waiting.
absl::StatusOr<FdMessage> ReceiveWithFd(int socket, size_t max_bytes, bool nonblocking = false);

// This host's identity: the kernel's boot id, the same for every process (and container) on it
// and different after a reboot. Empty when it cannot be read.
std::string HostId();

}  // namespace losshead::transport

#endif  // LOSSHEAD_TRANSPORT_FD_SOCKET_H_
