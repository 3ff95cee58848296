// The key a TCP peer (address and port) is known by to ConnectionGuard, the same whether it comes
// from the guard's accept (a sockaddr) or from gRPC's name for a call's peer (a URI): a family
// byte, the address bytes (4 or 16) and the port in network order. An IPv4 address mapped into
// IPv6 is keyed as the IPv4 one, as gRPC names it.
#ifndef LOSSHEAD_SERVER_RPC_PEER_KEY_H_
#define LOSSHEAD_SERVER_RPC_PEER_KEY_H_

#include <sys/socket.h>

#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace losshead::server {

// The key of an accepted peer; nullopt for a family other than IPv4 and IPv6.
std::optional<std::string> PeerKeyOfSockaddr(const sockaddr_storage& addr);

// The key of a peer as gRPC names it in a call's peer() ("ipv4:127.0.0.1:5000",
// "ipv6:[::1]:5000", percent-encoded or not). nullopt for anything else (unix:...).
std::optional<std::string> PeerKeyOfUri(absl::string_view uri);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_PEER_KEY_H_
