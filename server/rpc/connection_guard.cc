#include "server/rpc/connection_guard.h"

#include <fcntl.h>
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
#include "absl/strings/str_cat.h"
#include "server/rpc/tcp_listeners.h"

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

absl::StatusOr<std::unique_ptr<ConnectionGuard>> ConnectionGuard::Listen(const std::string& address,
                                                                         const Options& options,
                                                                         Metrics* metrics) {
  absl::StatusOr<TcpListeners> bound = ListenTcp(address);
  if (!bound.ok()) return bound.status();
  auto guard = std::unique_ptr<ConnectionGuard>(
      new ConnectionGuard(std::move(bound->fds), bound->port, options, metrics));
  if (guard->epoll_fd_ < 0 || guard->wake_fd_ < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, ": epoll/eventfd: ", Errno(errno)));
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
      timeout_ms = TendLocked(paused);
    }
    const int n = epoll_wait(epoll_fd_, events, kEvents, timeout_ms);
    for (int i = 0; i < n; ++i) OnEvent(events[i].data.u64);
  }
}

int ConnectionGuard::TendLocked(bool& paused) {
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
    WatchListenersLocked(EPOLLIN);
  } else if (!paused && now < accept_paused_until_) {
    paused = true;
    WatchListenersLocked(0);  // no events: the queue waits in the kernel
  }
  if (paused) wait = std::min(wait, accept_paused_until_ - now);
  return static_cast<int>(std::clamp<int64_t>(
      absl::ToInt64Milliseconds(absl::Ceil(wait, absl::Milliseconds(1))), 1, 1000));
}

void ConnectionGuard::WatchListenersLocked(uint32_t events) {
  for (int fd : listeners_) {
    epoll_event event{};
    event.events = events;
    event.data.u64 = static_cast<uint32_t>(fd);
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &event);
  }
}

void ConnectionGuard::OnEvent(uint64_t data) {
  const int fd = static_cast<int>(data & 0xffffffff);
  const uint64_t id = data >> 32;
  if (fd == wake_fd_) {
    uint64_t count;
    [[maybe_unused]] const ssize_t got = read(wake_fd_, &count, sizeof(count));
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    const bool listener =
        id == 0 && std::find(listeners_.begin(), listeners_.end(), fd) != listeners_.end();
    if (!listener) {
      // The peer hung up, or gRPC shut the socket down as it closed the connection. (An event of
      // a watch closed earlier in this batch may name a number reused since: the id tells.)
      auto at = connections_.find(fd);
      if (at != connections_.end() && (at->second.id & 0xffffffff) == id) {
        DropLocked(fd, /*shut=*/false);
      }
      return;
    }
  }
  AcceptAll(fd);
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
    std::optional<std::string> key = PeerKeyOfSockaddr(addr);
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
    if (!MakeRoomLocked() || !TrackLocked(fd, std::move(key))) {
      close(fd);
      if (metrics_ != nullptr) metrics_->ConnectionRefused();
      return;
    }
  }
  // gRPC owns `fd` from here (it closes it if it is shutting down).
  grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters params;
  params.listener_fd = listener;
  params.fd = fd;
  acceptor_->HandleNewConnection(&params);
}

bool ConnectionGuard::MakeRoomLocked() {
  if (connections_.size() >= options_.max_connections) {
    SweepLocked();  // connections gRPC let go of without a shutdown do not count
    next_sweep_ = absl::Now() + kSweepPeriod;
  }
  if (connections_.size() < options_.max_connections) return true;
  if (unproven_.empty()) return false;
  DropLocked(unproven_.front(), /*shut=*/true);
  if (metrics_ != nullptr) metrics_->ConnectionReaped("displaced");
  return true;
}

bool ConnectionGuard::TrackLocked(int fd, std::string key) {
  struct stat st {};
  const int watch = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (watch < 0 || fstat(fd, &st) != 0) {
    if (watch >= 0) close(watch);
    return false;
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
  return true;
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
