// Bounds the client connections of the gRPC TCP port, so that connections which only hold a
// socket cannot exhaust the process's file descriptors and lock out clients with work to do.
//
// The guard owns the listening sockets: it accepts each connection itself and hands it to gRPC
// (grpc::experimental::ExternalConnectionAcceptor: gRPC then runs TLS, HTTP/2 and the calls on it
// as on a connection of its own listener). That lets it count the connections, refuse one beyond
// a bound and close one, which gRPC 1.51 offers no way to do.
//
// A connection is *proven* once a call on it has been accepted by the server: with bearer tokens,
// a call of losshead.v1.LossHead that passed the token check (health and reflection need no token
// and prove nothing); without tokens, any call. Then:
//   - a connection not proven within `first_call_timeout` of its accept is closed (a TLS or
//     HTTP/2 handshake that never completes, an HTTP/2 preface and nothing else, calls without a
//     valid token);
//   - at `max_connections` open, a new connection takes the place of the oldest one not proven,
//     which is closed; when every open connection is proven, the new one is closed at once
//     (refused). So a client with a valid token always finds a place while any of the
//     connections is one that has not made a call, however many such connections are opened.
// Proven connections stay until their client or gRPC closes them (idle ones: the server's
// GRPC_ARG_MAX_CONNECTION_IDLE_MS).
//
// Each guarded connection costs two descriptors: gRPC's, and the guard's duplicate of it, which
// the guard watches (a hang-up, or gRPC shutting the socket down as it closes the connection, ends
// it) and through which it closes the connection: shutdown(2) of its own descriptor, which gRPC
// sees as the peer hanging up, so the guard never acts on a descriptor number gRPC may have
// reused. A periodic check (fstat of gRPC's descriptor against the socket's inode) also lets go
// of a connection that gRPC closed without a shutdown.
//
// Unix-socket listeners (unix:PATH) are not guarded: only local processes with access to the path
// can connect.
#ifndef LOSSHEAD_SERVER_RPC_CONNECTION_GUARD_H_
#define LOSSHEAD_SERVER_RPC_CONNECTION_GUARD_H_

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/observability/metrics.h"
#include "server/rpc/peer_key.h"  // the key connections are known by

namespace losshead::server {

// The soft RLIMIT_NOFILE now: the descriptors this process may hold.
size_t DescriptorLimit();
// The default of --max_connections under a descriptor limit of `descriptors`: what is left once
// a reserve for everything else the server opens (min(1024, descriptors / 4): files, devices,
// gRPC's own, the metrics endpoint) is set aside, halved because each connection takes two.
size_t DefaultMaxConnections(size_t descriptors);

class ConnectionGuard {
 public:
  struct Options {
    size_t max_connections = 1;                             // >= 1
    absl::Duration first_call_timeout = absl::Seconds(10);  // > 0
    // With bearer tokens only calls of losshead.v1.LossHead prove a connection (see above).
    bool tokens_required = false;
  };

  // Binds and listens on `address` (host:port; port 0 picks one; a host name binds each of its
  // addresses, on one port). UNAVAILABLE when that fails (in use, no such address).
  static absl::StatusOr<std::unique_ptr<ConnectionGuard>> Listen(const std::string& address,
                                                                 const Options& options,
                                                                 Metrics* metrics);
  // Stops accepting and lets go of every connection still tracked (gRPC's stay gRPC's).
  ~ConnectionGuard();

  int port() const { return port_; }
  // Before BuildAndStart: the builder serves the guard's connections with `credentials`, and the
  // returned factory (the builder's interceptor creators must include it) proves connections.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> AddTo(
      grpc::ServerBuilder& builder, std::shared_ptr<grpc::ServerCredentials> credentials);
  // After BuildAndStart: starts accepting.
  void Start();
  // Closes the listening sockets: new connections are refused by the kernel from now on; those
  // open stay (the server's shutdown closes them). Idempotent.
  void StopAccepting();

  // Guarded connections open now, and those of them not proven.
  size_t open() const;
  size_t unproven() const;
  // A call was accepted on the connection of `peer` (a call's peer() string).
  void Proven(absl::string_view peer);

 private:
  struct Connection {
    uint64_t id = 0;     // its epoll events carry it: a watch number may be reused
    std::string peer;    // PeerKeyOfUri's key
    int grpc_fd = -1;    // gRPC's descriptor (the guard never acts on it)
    uint64_t inode = 0;  // the socket's, to tell gRPC's descriptor from a reused number
    absl::Time accepted;
    bool proven = false;
    std::list<int>::iterator unproven_at;  // in unproven_, while not proven
  };

  ConnectionGuard(std::vector<int> listeners, int port, const Options& options, Metrics* metrics);
  // The guard's thread: waits for events, tending the table in between.
  void Run();
  // Between waits: closes the listeners once StopAccepting asked, reaps, sweeps, and pauses or
  // resumes accepting (`paused`: whether it is paused now); the wait until the next of these is
  // due, in milliseconds.
  int TendLocked(bool& paused) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets the listeners' epoll events: EPOLLIN to accept, none to leave the queue in the kernel.
  void WatchListenersLocked(uint32_t events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One epoll event (its data: the id and the descriptor): a wake-up, a listener with
  // connections to accept, or a connection that hung up.
  void OnEvent(uint64_t data);
  void AcceptAll(int listener);
  // Takes a new accepted socket `fd` from `listener` (peer `key`) into the table and hands it to
  // gRPC, or refuses it (fd closed).
  void Admit(int listener, int fd, std::string key);
  // Room for one more connection under max_connections, displacing the oldest one not proven if
  // need be; false when every open connection is proven.
  bool MakeRoomLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Watches `fd` (peer `key`) through a duplicate and enters it into the table, unproven; false
  // when it could not be duplicated or inspected (nothing of it kept).
  bool TrackLocked(int fd, std::string key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the connection watched by `watch`: shuts the socket down (gRPC sees the hang-up) when
  // `shut`, then forgets it.
  void DropLocked(int watch, bool shut) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the unproven connections past first_call_timeout; the time until the next one is due.
  absl::Duration ReapLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the connections gRPC closed without shutting their socket down.
  void SweepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Wake();

  const Options options_;
  Metrics* const metrics_;
  std::vector<int> listeners_;
  const int port_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool accepting_ ABSL_GUARDED_BY(mu_) = true;
  // By the guard's duplicate descriptor ("watch").
  absl::flat_hash_map<int, Connection> connections_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int> by_peer_ ABSL_GUARDED_BY(mu_);
  std::list<int> unproven_ ABSL_GUARDED_BY(mu_);  // watches, oldest accept first
  absl::Time next_sweep_ ABSL_GUARDED_BY(mu_);
  uint64_t last_id_ ABSL_GUARDED_BY(mu_) = 0;
  // Accepting paused after the process ran out of descriptors, until then.
  absl::Time accept_paused_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_CONNECTION_GUARD_H_
