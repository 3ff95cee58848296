#include "server/rpc/connection_guard.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"

namespace losshead::server {
namespace {

constexpr absl::string_view kLossHeadMethodPrefix = "/losshead.v1.LossHead/";
// How often the table is checked for connections gRPC closed without a shutdown (see the header),
// besides before a connection would be refused.
constexpr absl::Duration kSweepPeriod = absl::Seconds(5);
// After the process ran out of descriptors, accepting pauses this long (the connection waits in
// the kernel's queue) instead of spinning on a listener that stays readable.
constexpr absl::Duration kAcceptPause = absl::Milliseconds(100);
// Connections taken per listener wake-up, so that timeouts and hang-ups are served in between.
constexpr int kAcceptBurst = 256;

// Key layout: family byte, address bytes (4 or 16), port (2 bytes, network order).
std::string KeyOf(int family, const void* address, size_t size, uint16_t port_network_order) {
  std::string key(1, static_cast<char>(family));
  key.append(static_cast<const char*>(address), size);
  key.append(reinterpret_cast<const char*>(&port_network_order), sizeof(port_network_order));
  return key;
}

// The key of an accepted peer; an IPv4 address mapped into IPv6 is keyed as the IPv4 one, as
// gRPC names it.
std::optional<std::string> KeyOfSockaddr(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(addr);
    return KeyOf(AF_INET, &in.sin_addr, sizeof(in.sin_addr), in.sin_port);
  }
  if (addr.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(addr);
    if (IN6_IS_ADDR_V4MAPPED(&in6.sin6_addr)) {
      return KeyOf(AF_INET, &in6.sin6_addr.s6_addr[12], 4, in6.sin6_port);
    }
    return KeyOf(AF_INET6, &in6.sin6_addr, sizeof(in6.sin6_addr), in6.sin6_port);
  }
  return std::nullopt;
}

int SetInt(int fd, int level, int name, int value) {
  return setsockopt(fd, level, name, &value, sizeof(value));
}

std::string Errno(int error) { return std::strerror(error); }

// The interceptor factory that proves connections: it installs no interceptor (the Step path
// stays free of them), it only looks at each call as it starts.
class ProvingFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  ProvingFactory(ConnectionGuard* guard, bool tokens_required)
      : guard_(guard), tokens_required_(tokens_required) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // With tokens, a call of the service reaches this point only once its token was accepted;
    // health and reflection need none.
    if (tokens_required_ && !absl::StartsWith(info->method(), kLossHeadMethodPrefix)) {
      return nullptr;
    }
    if (info->server_context() != nullptr) guard_->Proven(info->server_context()->peer());
    return nullptr;
  }

 private:
  ConnectionGuard* const guard_;
  const bool tokens_required_;
};

}  // namespace

size_t DescriptorLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return size_t{1} << 20;
  }
  return static_cast<size_t>(limit.rlim_cur);
}

size_t DefaultMaxConnections(size_t descriptors) {
  const size_t reserve = std::min<size_t>(1024, descriptors / 4);
  return std::max<size_t>(1, (descriptors - reserve) / 2);
}

std::optional<std::string> PeerKeyOfUri(absl::string_view uri) {
  int family;
  if (absl::ConsumePrefix(&uri, "ipv4:")) {
    family = AF_INET;
  } else if (absl::ConsumePrefix(&uri, "ipv6:")) {
    family = AF_INET6;
  } else {
    return std::nullopt;
  }
  // gRPC percent-encodes the brackets (and a scope's %) of an IPv6 address in some versions.
  std::string text = absl::StrReplaceAll(uri, {{"%5B", "["}, {"%5D", "]"}, {"%25", "%"}});
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos) return std::nullopt;
  int port = 0;
  if (!absl::SimpleAtoi(absl::string_view(text).substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return std::nullopt;
  }
  std::string host = text.substr(0, colon);
  if (family == AF_INET6) {
    if (host.size() < 2 || host.front() != '[' || host.back() != ']') return std::nullopt;
    host = host.substr(1, host.size() - 2);
    host = host.substr(0, host.find('%'));  // a scope id: the address alone keys it
  }
  sockaddr_storage addr{};
  addr.ss_family = static_cast<sa_family_t>(family);
  if (family == AF_INET) {
    auto& in = reinterpret_cast<sockaddr_in&>(addr);
    if (inet_pton(AF_INET, host.c_str(), &in.sin_addr) != 1) return std::nullopt;
    in.sin_port = htons(static_cast<uint16_t>(port));
  } else {
    auto& in6 = reinterpret_cast<sockaddr_in6&>(addr);
    if (inet_pton(AF_INET6, host.c_str(), &in6.sin6_addr) != 1) return std::nullopt;
    in6.sin6_port = htons(static_cast<uint16_t>(port));
  }
  return KeyOfSockaddr(addr);
}

absl::StatusOr<std::unique_ptr<ConnectionGuard>> ConnectionGuard::Listen(const std::string& address,
                                                                         const Options& options,
                                                                         Metrics* metrics) {
  auto unavailable = [&address](absl::string_view why) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ": ", why));
  };
  std::string host;
  std::string port;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find("]:");
    if (close == std::string::npos) return unavailable("expected [host]:port");
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) return unavailable("expected host:port");
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
  }
  int port_number = 0;
  if (!absl::SimpleAtoi(port, &port_number) || port_number < 0 || port_number > 65535) {
    return unavailable("bad port");
  }

  // The addresses to bind, in order. A wildcard host, as gRPC's own listener does it: one IPv6
  // socket that takes IPv4 too (dual stack), or IPv4 alone where the host has no IPv6.
  struct Candidate {
    sockaddr_storage addr{};
    socklen_t length = 0;
    bool v6only = false;
    bool fallback = false;  // only when nothing before it could be bound
  };
  std::vector<Candidate> candidates;
  if (host.empty() || host == "*" || host == "0.0.0.0" || host == "::") {
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
  } else {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const int resolved = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
    if (resolved != 0) return unavailable(gai_strerror(resolved));
    bool has_v4 = false;
    for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
      has_v4 |= a->ai_family == AF_INET;
    }
    for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
      if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
      Candidate c;
      std::memcpy(&c.addr, a->ai_addr, a->ai_addrlen);
      c.length = a->ai_addrlen;
      c.v6only = has_v4;  // the host's IPv4 addresses have sockets of their own
      candidates.push_back(c);
    }
    freeaddrinfo(found);
  }

  std::vector<int> listeners;
  int bound_port = port_number;
  std::string last_error = "no address";
  for (Candidate& c : candidates) {
    if (c.fallback && !listeners.empty()) break;
    // Port 0: every address on the port the first one got.
    if (c.addr.ss_family == AF_INET) {
      reinterpret_cast<sockaddr_in&>(c.addr).sin_port = htons(static_cast<uint16_t>(bound_port));
    } else {
      reinterpret_cast<sockaddr_in6&>(c.addr).sin6_port = htons(static_cast<uint16_t>(bound_port));
    }
    const int fd = socket(c.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = Errno(errno);
      continue;
    }
    // As gRPC's own listener: quick restarts on the port, no SO_REUSEPORT (a second server must
    // not share the port silently), low latency.
    SetInt(fd, SOL_SOCKET, SO_REUSEADDR, 1);
    SetInt(fd, IPPROTO_TCP, TCP_NODELAY, 1);
    if (c.addr.ss_family == AF_INET6) SetInt(fd, IPPROTO_IPV6, IPV6_V6ONLY, c.v6only ? 1 : 0);
    if (bind(fd, reinterpret_cast<const sockaddr*>(&c.addr), c.length) != 0 ||
        listen(fd, SOMAXCONN) != 0) {
      const int error = errno;
      close(fd);
      // An address family the host lacks (IPv6 off) is skipped when another one binds.
      if (error == EADDRNOTAVAIL || error == EAFNOSUPPORT) {
        last_error = Errno(error);
        continue;
      }
      for (int l : listeners) close(l);
      return unavailable(Errno(error));
    }
    if (bound_port == 0) {
      sockaddr_storage local{};
      socklen_t length = sizeof(local);
      if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
        bound_port = ntohs(local.ss_family == AF_INET
                               ? reinterpret_cast<const sockaddr_in&>(local).sin_port
                               : reinterpret_cast<const sockaddr_in6&>(local).sin6_port);
      }
    }
    listeners.push_back(fd);
  }
  if (listeners.empty()) return unavailable(last_error);
  auto guard = std::unique_ptr<ConnectionGuard>(
      new ConnectionGuard(std::move(listeners), bound_port, options, metrics));
  if (guard->epoll_fd_ < 0 || guard->wake_fd_ < 0) {
    return unavailable(absl::StrCat("epoll/eventfd: ", Errno(errno)));
  }
  return guard;
}

ConnectionGuard::ConnectionGuard(std::vector<int> listeners, int port, const Options& options,
                                 Metrics* metrics)
    : options_(options),
      metrics_(metrics),
      listeners_(std::move(listeners)),
      port_(port),
      epoll_fd_(epoll_create1(EPOLL_CLOEXEC)),
      wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (epoll_fd_ < 0 || wake_fd_ < 0) return;
  // Listeners and the wake-up descriptor carry id 0 (see Run).
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = static_cast<uint32_t>(wake_fd_);
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &event);
  for (int fd : listeners_) {
    event.data.u64 = static_cast<uint32_t>(fd);
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event);
  }
  absl::MutexLock lock(&mu_);
  next_sweep_ = absl::Now() + kSweepPeriod;
}

ConnectionGuard::~ConnectionGuard() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  Wake();
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  // gRPC keeps its descriptors; the guard's duplicates go.
  for (const auto& [watch, connection] : connections_) close(watch);
  connections_.clear();
  by_peer_.clear();
  unproven_.clear();
  for (int fd : listeners_) close(fd);
  listeners_.clear();
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> ConnectionGuard::AddTo(
    grpc::ServerBuilder& builder, std::shared_ptr<grpc::ServerCredentials> credentials) {
  acceptor_ = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD,
      std::move(credentials));
  return std::make_unique<ProvingFactory>(this, options_.tokens_required);
}

void ConnectionGuard::Start() {
  if (thread_.joinable()) return;
  thread_ = std::thread([this] { Run(); });
}

void ConnectionGuard::StopAccepting() {
  absl::MutexLock lock(&mu_);
  if (!accepting_) return;
  accepting_ = false;
  if (!thread_.joinable()) {  // never started: nothing else uses the listeners
    for (int fd : listeners_) close(fd);
    listeners_.clear();
    return;
  }
  Wake();
  // The guard's thread closes them (it may be inside accept on one): wait for it.
  mu_.Await(absl::Condition(
      +[](std::vector<int>* listeners) { return listeners->empty(); }, &listeners_));
}

size_t ConnectionGuard::open() const {
  absl::MutexLock lock(&mu_);
  return connections_.size();
}

size_t ConnectionGuard::unproven() const {
  absl::MutexLock lock(&mu_);
  return unproven_.size();
}

void ConnectionGuard::Proven(absl::string_view peer) {
  const std::optional<std::string> key = PeerKeyOfUri(peer);
  if (!key.has_value()) return;
  absl::MutexLock lock(&mu_);
  auto at = by_peer_.find(*key);
  if (at == by_peer_.end()) return;
  Connection& connection = connections_.at(at->second);
  if (connection.proven) return;
  connection.proven = true;
  unproven_.erase(connection.unproven_at);
}

void ConnectionGuard::Wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t written = write(wake_fd_, &one, sizeof(one));
}

void ConnectionGuard::Run() {
  constexpr int kEvents = 64;
  epoll_event events[kEvents];
  bool paused = false;
  while (true) {
    int timeout_ms;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      if (!accepting_ && !listeners_.empty()) {
        for (int fd : listeners_) {
          epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
          close(fd);
        }
        listeners_.clear();  // StopAccepting returns
      }
      const absl::Time now = absl::Now();
      absl::Duration wait = std::min(ReapLocked(now), absl::Seconds(1));
      if (now >= next_sweep_) {
        SweepLocked();
        next_sweep_ = now + kSweepPeriod;
      }
      if (paused && now >= accept_paused_until_) {
        paused = false;
        for (int fd : listeners_) {
          epoll_event event{};
          event.events = EPOLLIN;
          event.data.u64 = static_cast<uint32_t>(fd);
          epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &event);
        }
      } else if (!paused && now < accept_paused_until_) {
        paused = true;
        for (int fd : listeners_) {
          epoll_event event{};  // no events: the queue waits in the kernel
          event.data.u64 = static_cast<uint32_t>(fd);
          epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &event);
        }
      }
      if (paused) wait = std::min(wait, accept_paused_until_ - now);
      timeout_ms = static_cast<int>(std::clamp<int64_t>(
          absl::ToInt64Milliseconds(absl::Ceil(wait, absl::Milliseconds(1))), 1, 1000));
    }
    const int n = epoll_wait(epoll_fd_, events, kEvents, timeout_ms);
    for (int i = 0; i < n; ++i) {
      const int fd = static_cast<int>(events[i].data.u64 & 0xffffffff);
      const uint64_t id = events[i].data.u64 >> 32;
      if (fd == wake_fd_) {
        uint64_t count;
        [[maybe_unused]] const ssize_t got = read(wake_fd_, &count, sizeof(count));
        continue;
      }
      bool listener;
      {
        absl::MutexLock lock(&mu_);
        listener =
            id == 0 && std::find(listeners_.begin(), listeners_.end(), fd) != listeners_.end();
        if (!listener) {
          // The peer hung up, or gRPC shut the socket down as it closed the connection. (An
          // event of a watch closed earlier in this batch may name a number reused since: the
          // id tells.)
          auto at = connections_.find(fd);
          if (at != connections_.end() && (at->second.id & 0xffffffff) == id) {
            DropLocked(fd, /*shut=*/false);
          }
          continue;
        }
      }
      AcceptAll(fd);
    }
  }
}

void ConnectionGuard::AcceptAll(int listener) {
  for (int i = 0; i < kAcceptBurst; ++i) {
    sockaddr_storage addr{};
    socklen_t length = sizeof(addr);
    const int fd = accept4(listener, reinterpret_cast<sockaddr*>(&addr), &length,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int error = errno;
      if (error == EINTR || error == ECONNABORTED || error == EPROTO) continue;
      if (error == EAGAIN || error == EWOULDBLOCK) return;
      if (error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM) {
        // Out of descriptors (or memory) despite the bound: something else holds them. The
        // oldest connection without a call makes room, and accepting pauses briefly.
        absl::MutexLock lock(&mu_);
        if (!unproven_.empty()) {
          DropLocked(unproven_.front(), /*shut=*/true);
          if (metrics_ != nullptr) metrics_->ConnectionReaped("displaced");
        }
        if (accept_paused_until_ < absl::Now()) {
          std::fprintf(stderr, "losshead-server: cannot accept a connection: %s\n",
                       Errno(error).c_str());
        }
        accept_paused_until_ = absl::Now() + kAcceptPause;
        Wake();
        return;
      }
      std::fprintf(stderr, "losshead-server: accept failed: %s\n", Errno(error).c_str());
      return;
    }
    std::optional<std::string> key = KeyOfSockaddr(addr);
    if (!key.has_value()) {
      close(fd);
      continue;
    }
    SetInt(fd, IPPROTO_TCP, TCP_NODELAY, 1);
    Admit(listener, fd, std::move(*key));
  }
}

void ConnectionGuard::Admit(int listener, int fd, std::string key) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || !accepting_) {
      close(fd);
      return;
    }
    if (connections_.size() >= options_.max_connections) {
      SweepLocked();  // connections gRPC let go of without a shutdown do not count
      next_sweep_ = absl::Now() + kSweepPeriod;
    }
    if (connections_.size() >= options_.max_connections) {
      if (unproven_.empty()) {
        close(fd);
        if (metrics_ != nullptr) metrics_->ConnectionRefused();
        return;
      }
      DropLocked(unproven_.front(), /*shut=*/true);
      if (metrics_ != nullptr) metrics_->ConnectionReaped("displaced");
    }
    struct stat st {};
    const int watch = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (watch < 0 || fstat(fd, &st) != 0) {
      if (watch >= 0) close(watch);
      close(fd);
      if (metrics_ != nullptr) metrics_->ConnectionRefused();
      return;
    }
    const uint64_t id = (++last_id_ & 0xffffffff) == 0 ? ++last_id_ : last_id_;  // never 0
    epoll_event event{};
    event.events = EPOLLRDHUP;  // with EPOLLHUP and EPOLLERR, always reported; never data
    event.data.u64 = ((id & 0xffffffff) << 32) | static_cast<uint32_t>(watch);
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, watch, &event);
    // The same address and port again: the connection that had them is gone.
    if (auto old = by_peer_.find(key); old != by_peer_.end()) DropLocked(old->second, true);
    unproven_.push_back(watch);
    Connection& connection = connections_[watch];
    connection.id = id;
    connection.peer = key;
    connection.grpc_fd = fd;
    connection.inode = st.st_ino;
    connection.accepted = absl::Now();
    connection.unproven_at = std::prev(unproven_.end());
    by_peer_[key] = watch;
    if (metrics_ != nullptr) {
      metrics_->ConnectionAccepted();
      metrics_->ConnectionsOpen(connections_.size());
    }
  }
  // gRPC owns `fd` from here (it closes it if it is shutting down).
  grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters params;
  params.listener_fd = listener;
  params.fd = fd;
  acceptor_->HandleNewConnection(&params);
}

void ConnectionGuard::DropLocked(int watch, bool shut) {
  auto at = connections_.find(watch);
  if (at == connections_.end()) return;
  Connection& connection = at->second;
  // gRPC sees the shutdown as the peer hanging up and closes its side; so does the peer.
  if (shut) shutdown(watch, SHUT_RDWR);
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, watch, nullptr);
  close(watch);
  if (!connection.proven) unproven_.erase(connection.unproven_at);
  if (auto peer = by_peer_.find(connection.peer); peer != by_peer_.end() && peer->second == watch) {
    by_peer_.erase(peer);
  }
  connections_.erase(at);
  if (metrics_ != nullptr) metrics_->ConnectionsOpen(connections_.size());
}

absl::Duration ConnectionGuard::ReapLocked(absl::Time now) {
  while (!unproven_.empty()) {
    const int watch = unproven_.front();
    const absl::Time due = connections_.at(watch).accepted + options_.first_call_timeout;
    if (now < due) return due - now;
    DropLocked(watch, /*shut=*/true);
    if (metrics_ != nullptr) metrics_->ConnectionReaped("first_call_timeout");
  }
  return absl::InfiniteDuration();
}

void ConnectionGuard::SweepLocked() {
  std::vector<int> gone;
  for (const auto& [watch, connection] : connections_) {
    struct stat st {};
    if (fstat(connection.grpc_fd, &st) != 0 || st.st_ino != connection.inode) {
      gone.push_back(watch);
    }
  }
  for (int watch : gone) DropLocked(watch, /*shut=*/false);
}

}  // namespace losshead::server
