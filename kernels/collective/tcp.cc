#include "kernels/collective/tcp.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace losshead::kernels::tcp {
namespace {

// Resolved addresses, freed on destruction.
class AddrInfo {
 public:
  ~AddrInfo() {
    if (list_ != nullptr) freeaddrinfo(list_);
  }
  addrinfo** out() { return &list_; }
  const addrinfo* get() const { return list_; }

 private:
  addrinfo* list_ = nullptr;
};

absl::Status Resolve(const HostPort& address, bool passive, AddrInfo* out) {
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  const char* host = address.host.empty() ? nullptr : address.host.c_str();
  if (int err = getaddrinfo(host, address.port.c_str(), &hints, out->out()); err != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", address.host, ":", address.port, ": ", gai_strerror(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<Fd> NonBlockingSocket(const addrinfo& ai) {
  Fd fd(socket(ai.ai_family, ai.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai.ai_protocol));
  if (!fd.valid()) return absl::UnavailableError(absl::StrCat("socket: ", ErrnoText(errno)));
  return fd;
}

// Small messages (headers, hellos) go out at once rather than waiting for more.
void NoDelay(const Fd& fd) {
  const int one = 1;
  setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Waits for `events` on fd until the deadline: true when ready, false when the deadline passed.
absl::StatusOr<bool> WaitFor(const Fd& fd, short events, absl::Time deadline) {
  while (true) {
    pollfd p{fd.get(), events, 0};
    const int n = poll(&p, 1, PollMillis(deadline));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("poll: ", ErrnoText(errno)));
    }
    if (n == 0 && absl::Now() >= deadline) return false;
  }
}

}  // namespace

std::string ErrnoText(int err) {
  char buffer[256];
  // The GNU strerror_r returns the text, which may or may not be `buffer`.
  return std::string(strerror_r(err, buffer, sizeof(buffer)));
}

int PollMillis(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  const int64_t ms = absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)));
  return static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

absl::StatusOr<HostPort> ParseHostPort(absl::string_view address) {
  HostPort out;
  absl::string_view port;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos || close + 1 >= address.size() ||
        address[close + 1] != ':') {
      return absl::InvalidArgumentError(
          absl::StrCat("address \"", address, "\" is not [v6addr]:port"));
    }
    out.host = std::string(address.substr(1, close - 1));
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos || address.find(':') != colon) {
      return absl::InvalidArgumentError(absl::StrCat("address \"", address, "\" is not host:port"));
    }
    out.host = std::string(address.substr(0, colon));
    port = address.substr(colon + 1);
  }
  int number = 0;
  if (!absl::SimpleAtoi(port, &number) || number < 1 || number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("address \"", address, "\" has no port in [1, 65535]"));
  }
  out.port = absl::StrCat(number);
  return out;
}

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    Close();
    fd_ = other.Release();
  }
  return *this;
}

void Fd::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

absl::StatusOr<Fd> Listen(const HostPort& at) {
  AddrInfo addresses;
  if (absl::Status s = Resolve(at, /*passive=*/true, &addresses); !s.ok()) return s;
  std::string errors;
  for (const addrinfo* ai = addresses.get(); ai != nullptr; ai = ai->ai_next) {
    absl::StatusOr<Fd> fd = NonBlockingSocket(*ai);
    if (!fd.ok()) return fd.status();
    const int one = 1;
    setsockopt(fd->get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd->get(), ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd->get(), 128) != 0) {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", ErrnoText(errno));
      continue;
    }
    return std::move(*fd);
  }
  return absl::UnavailableError(
      absl::StrCat("cannot listen on ", at.host, ":", at.port, ": ", errors));
}

absl::StatusOr<Fd> Connect(const HostPort& to, absl::Time deadline) {
  AddrInfo addresses;
  if (absl::Status s = Resolve(to, /*passive=*/false, &addresses); !s.ok()) return s;
  std::string errors;
  for (const addrinfo* ai = addresses.get(); ai != nullptr; ai = ai->ai_next) {
    absl::StatusOr<Fd> fd = NonBlockingSocket(*ai);
    if (!fd.ok()) return fd.status();
    int err = 0;
    if (connect(fd->get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        absl::StatusOr<bool> ready = WaitFor(*fd, POLLOUT, deadline);
        if (!ready.ok()) return ready.status();
        if (!*ready) {
          return absl::DeadlineExceededError(
              absl::StrCat("connect to ", to.host, ":", to.port, " timed out"));
        }
        socklen_t length = sizeof(err);
        getsockopt(fd->get(), SOL_SOCKET, SO_ERROR, &err, &length);
      }
    }
    if (err != 0) {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", ErrnoText(err));
      continue;
    }
    NoDelay(*fd);
    return std::move(*fd);
  }
  return absl::UnavailableError(absl::StrCat("connect to ", to.host, ":", to.port, ": ", errors));
}

absl::StatusOr<Fd> Accept(const Fd& listener, absl::Time deadline) {
  while (true) {
    absl::StatusOr<bool> ready = WaitFor(listener, POLLIN, deadline);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("no connection came");
    Fd fd(accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (fd.valid()) {
      NoDelay(fd);
      return fd;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
      return absl::UnavailableError(absl::StrCat("accept: ", ErrnoText(errno)));
    }
  }
}

absl::Status WriteAll(const Fd& fd, std::span<const std::byte> bytes, absl::Time deadline) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = send(fd.get(), bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("send: ", ErrnoText(errno)));
    }
    absl::StatusOr<bool> ready = WaitFor(fd, POLLOUT, deadline);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("send timed out");
  }
  return absl::OkStatus();
}

absl::Status ReadAll(const Fd& fd, std::span<std::byte> bytes, absl::Time deadline) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = recv(fd.get(), bytes.data() + done, bytes.size() - done, 0);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return absl::UnavailableError("the peer closed the connection");
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("recv: ", ErrnoText(errno)));
    }
    absl::StatusOr<bool> ready = WaitFor(fd, POLLIN, deadline);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("receive timed out");
  }
  return absl::OkStatus();
}

}  // namespace losshead::kernels::tcp
