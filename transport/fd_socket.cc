#include "transport/fd_socket.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace losshead::transport {
namespace {

absl::Status Errno(absl::string_view what, const std::string& name) {
  const int e = errno;
  return absl::UnavailableError(absl::StrCat(what, " ", name, ": ", std::strerror(e)));
}

absl::StatusOr<std::pair<sockaddr_un, socklen_t>> Address(const std::string& name) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const bool abstract = !name.empty() && name[0] == '@';
  if (name.size() < 2 || name.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("bad Unix socket name '", name, "'"));
  }
  std::memcpy(addr.sun_path, name.data(), name.size());
  if (abstract) addr.sun_path[0] = '\0';
  const socklen_t length =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size() + (abstract ? 0 : 1));
  return std::make_pair(addr, length);
}

}  // namespace

OwnedFd& OwnedFd::operator=(OwnedFd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

void OwnedFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

absl::StatusOr<OwnedFd> ListenSeqpacket(const std::string& name) {
  auto addr = Address(name);
  if (!addr.ok()) return addr.status();
  OwnedFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (fd.get() < 0) return Errno("socket for", name);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr->first), addr->second) != 0) {
    return Errno("bind", name);
  }
  if (::listen(fd.get(), 128) != 0) return Errno("listen on", name);
  return fd;
}

absl::StatusOr<OwnedFd> ConnectSeqpacket(const std::string& name) {
  auto addr = Address(name);
  if (!addr.ok()) return addr.status();
  OwnedFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return Errno("socket for", name);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr->first), addr->second) != 0) {
    return Errno("connect to", name);
  }
  return fd;
}

absl::Status SendWithFd(int socket, absl::string_view bytes, int fd) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
  }
  ssize_t sent;
  do {
    sent = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0) return Errno("sendmsg on", "a Unix socket");
  if (static_cast<size_t>(sent) != bytes.size()) {
    return absl::UnavailableError("a Unix socket message was sent in part");
  }
  return absl::OkStatus();
}

absl::StatusOr<FdMessage> ReceiveWithFd(int socket, size_t max_bytes, bool nonblocking) {
  FdMessage out;
  // One byte more than the limit shows a message that is too long (SEQPACKET truncates it).
  std::string buffer(max_bytes + 1, '\0');
  iovec iov{buffer.data(), buffer.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  // Room for a few descriptors, so that extra ones are received (and closed), not left behind.
  alignas(cmsghdr) char control[CMSG_SPACE(8 * sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t got;
  do {
    got = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC | (nonblocking ? MSG_DONTWAIT : 0));
  } while (got < 0 && errno == EINTR);
  if (got < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::UnavailableError("no message");
    if (errno == ECONNRESET) {
      out.closed = true;
      return out;
    }
    return Errno("recvmsg on", "a Unix socket");
  }
  std::vector<OwnedFd> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.emplace_back(fd);
    }
  }
  if (got == 0 && fds.empty()) {
    out.closed = true;
    return out;
  }
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0 || static_cast<size_t>(got) > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a control message longer than ", max_bytes,
                                                   " bytes or with too many "
                                                   "descriptors"));
  }
  if (fds.size() > 1) {
    return absl::InvalidArgumentError("a control message with more than one descriptor");
  }
  buffer.resize(static_cast<size_t>(got));
  out.bytes = std::move(buffer);
  if (!fds.empty()) out.fd = std::move(fds[0]);
  return out;
}

std::string HostId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return std::string(absl::StripAsciiWhitespace(id));
}

}  // namespace losshead::transport
