// The same-node path's control socket (docs/same-node.md): a Unix SOCK_SEQPACKET socket in the
// abstract namespace where a client on this host registers a shared memory region by sending its
// memfd (SharedMemoryRegister with the descriptor in SCM_RIGHTS), or a device region by sending its
// CUDA IPC handle (SharedMemoryRegister.kind DEVICE). One region per connection; the
// region lives as long as the connection, so a client that closes it or dies (the kernel closes
// its sockets) leaves nothing registered. One thread serves every connection with poll().
//
// A registration must come within kRegisterTimeout of the connect and present a writer's bearer
// token where the server asks for tokens; at most kMaxConnections connections are open at once
// (beyond it a new one is closed at its accept).
#ifndef LOSSHEAD_SERVER_RPC_SAME_NODE_LISTENER_H_
#define LOSSHEAD_SERVER_RPC_SAME_NODE_LISTENER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/rpc/shared_regions.h"
#include "transport/fd_socket.h"

namespace losshead::server {

class TokenTable;

class SameNodeListener {
 public:
  static constexpr size_t kMaxConnections = 4096;
  static constexpr absl::Duration kRegisterTimeout = absl::Seconds(10);

  // Listens on a fresh abstract name; `tokens` null: no tokens asked. Both outlive the listener.
  static absl::StatusOr<std::unique_ptr<SameNodeListener>> Start(SharedRegions* regions,
                                                                 const TokenTable* tokens);
  // Stops the thread and closes every connection (their regions are unregistered).
  ~SameNodeListener();

  // The socket's name as SameNode.socket advertises it ("@...").
  const std::string& socket_name() const { return name_; }

 private:
  SameNodeListener(SharedRegions* regions, const TokenTable* tokens, std::string name,
                   transport::OwnedFd listen, transport::OwnedFd wake_read,
                   transport::OwnedFd wake_write);
  void Loop();

  SharedRegions* const regions_;
  const TokenTable* const tokens_;
  const std::string name_;
  transport::OwnedFd listen_;
  transport::OwnedFd wake_read_;
  transport::OwnedFd wake_write_;
  std::thread thread_;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_SAME_NODE_LISTENER_H_
