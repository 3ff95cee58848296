#include "server/rpc/tcp_listeners.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace losshead::server {
namespace {

// One address to bind.
struct Candidate {
  sockaddr_storage addr{};
  socklen_t length = 0;
  bool v6only = false;
  bool fallback = false;  // only when nothing before it could be bound
};

int SetInt(int fd, int level, int name, int value) {
  return setsockopt(fd, level, name, &value, sizeof(value));
}

std::string Errno(int error) { return std::strerror(error); }

// `address` as its host and port ("[host]:port" for an IPv6 literal), and the port's number; an
// error's message says why it is not one.
absl::Status SplitHostPort(const std::string& address, std::string& host, std::string& port,
                           int& port_number) {
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find("]:");
    if (close == std::string::npos) return absl::InvalidArgumentError("expected [host]:port");
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) return absl::InvalidArgumentError("expected host:port");
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
  }
  if (!absl::SimpleAtoi(port, &port_number) || port_number < 0 || port_number > 65535) {
    return absl::InvalidArgumentError("bad port");
  }
  return absl::OkStatus();
}

bool IsWildcard(const std::string& host) {
  return host.empty() || host == "*" || host == "0.0.0.0" || host == "::";
}

// A wildcard host, as gRPC's own listener does it: one IPv6 socket that takes IPv4 too (dual
// stack), or IPv4 alone where the host has no IPv6.
std::vector<Candidate> WildcardCandidates() {
  std::vector<Candidate> candidates;
  Candidate v6;
  auto& in6 = reinterpret_cast<sockaddr_in6&>(v6.addr);
  in6.sin6_family = AF_INET6;
  in6.sin6_addr = in6addr_any;
  v6.length = sizeof(sockaddr_in6);
  candidates.push_back(v6);
  Candidate v4;
  auto& in = reinterpret_cast<sockaddr_in&>(v4.addr);
  in.sin_family = AF_INET;
  in.sin_addr.s_addr = htonl(INADDR_ANY);
  v4.length = sizeof(sockaddr_in);
  v4.fallback = true;
  candidates.push_back(v4);
  return candidates;
}

// Each IPv4 and IPv6 address of `host`, in getaddrinfo's order; an error's message says why not.
absl::StatusOr<std::vector<Candidate>> ResolvedCandidates(const std::string& host,
                                                          const std::string& port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int resolved = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  if (resolved != 0) return absl::UnavailableError(gai_strerror(resolved));
  bool has_v4 = false;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    has_v4 |= a->ai_family == AF_INET;
  }
  std::vector<Candidate> candidates;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
    Candidate c;
    std::memcpy(&c.addr, a->ai_addr, a->ai_addrlen);
    c.length = a->ai_addrlen;
    c.v6only = has_v4;  // the host's IPv4 addresses have sockets of their own
    candidates.push_back(c);
  }
  freeaddrinfo(found);
  return candidates;
}

// A listening socket on `c` at `port`, or -1 with errno's value in `error`; `fatal` when no
// further address should be tried (an address family the host lacks, IPv6 off, is skipped when
// another one binds; a port in use is not).
int BindListener(Candidate& c, int port, int& error, bool& fatal) {
  fatal = false;
  if (c.addr.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in&>(c.addr).sin_port = htons(static_cast<uint16_t>(port));
  } else {
    reinterpret_cast<sockaddr_in6&>(c.addr).sin6_port = htons(static_cast<uint16_t>(port));
  }
  const int fd = socket(c.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    error = errno;
    return -1;
  }
  SetInt(fd, SOL_SOCKET, SO_REUSEADDR, 1);
  SetInt(fd, IPPROTO_TCP, TCP_NODELAY, 1);
  if (c.addr.ss_family == AF_INET6) SetInt(fd, IPPROTO_IPV6, IPV6_V6ONLY, c.v6only ? 1 : 0);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&c.addr), c.length) != 0 ||
      listen(fd, SOMAXCONN) != 0) {
    error = errno;
    close(fd);
    fatal = error != EADDRNOTAVAIL && error != EAFNOSUPPORT;
    return -1;
  }
  return fd;
}

// The port `fd` is bound to; 0 when it cannot be read.
int LocalPort(int fd) {
  sockaddr_storage local{};
  socklen_t length = sizeof(local);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) != 0) return 0;
  return ntohs(local.ss_family == AF_INET ? reinterpret_cast<const sockaddr_in&>(local).sin_port
                                          : reinterpret_cast<const sockaddr_in6&>(local).sin6_port);
}

}  // namespace

absl::StatusOr<TcpListeners> ListenTcp(const std::string& address) {
  auto unavailable = [&address](absl::string_view why) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ": ", why));
  };
  std::string host;
  std::string port;
  int port_number = 0;
  if (absl::Status split = SplitHostPort(address, host, port, port_number); !split.ok()) {
    return unavailable(split.message());
  }
  // The addresses to bind, in order.
  std::vector<Candidate> candidates;
  if (IsWildcard(host)) {
    candidates = WildcardCandidates();
  } else {
    absl::StatusOr<std::vector<Candidate>> resolved = ResolvedCandidates(host, port);
    if (!resolved.ok()) return unavailable(resolved.status().message());
    candidates = *std::move(resolved);
  }
  TcpListeners bound{.port = port_number};
  std::string last_error = "no address";
  for (Candidate& c : candidates) {
    if (c.fallback && !bound.fds.empty()) break;
    // Port 0: every address on the port the first one got.
    int error = 0;
    bool fatal = false;
    const int fd = BindListener(c, bound.port, error, fatal);
    if (fd < 0) {
      if (fatal) {
        for (int l : bound.fds) close(l);
        return unavailable(Errno(error));
      }
      last_error = Errno(error);
      continue;
    }
    if (bound.port == 0) bound.port = LocalPort(fd);
    bound.fds.push_back(fd);
  }
  if (bound.fds.empty()) return unavailable(last_error);
  return bound;
}

}  // namespace losshead::server
