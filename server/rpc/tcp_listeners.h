// The listening TCP sockets of one address, bound as gRPC's own listener binds them, for
// ConnectionGuard to accept on: quick restarts on the port (SO_REUSEADDR), no SO_REUSEPORT (a
// second server must not share the port silently), TCP_NODELAY, and a wildcard host as one dual
// stack IPv6 socket (IPv4 alone where the host has no IPv6).
#ifndef LOSSHEAD_SERVER_RPC_TCP_LISTENERS_H_
#define LOSSHEAD_SERVER_RPC_TCP_LISTENERS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace losshead::server {

struct TcpListeners {
  std::vector<int> fds;  // listening, non-blocking, close-on-exec; the caller closes them
  int port = 0;          // the port they share (the one the first got, for port 0)
};

// Binds and listens on `address` (host:port; port 0 picks one; a host name binds each of its
// addresses, on one port). UNAVAILABLE ("cannot listen on ADDRESS: why") when that fails (in use,
// no such address); nothing stays open then.
absl::StatusOr<TcpListeners> ListenTcp(const std::string& address);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_TCP_LISTENERS_H_
