// The group secret's check on each connection of a process group's bootstrap (process_group.h),
// right after both ends exchanged and checked their hellos.
//
// Protocol (both ends hold the same view of it; `connector` is the higher rank, which connected):
//   1. Each end sends an offer: whether it holds a secret, and 32 random bytes (its nonce).
//      Offers that disagree on holding a secret: PERMISSION_DENIED on both ends, nothing more sent.
//   2. Both hold one: the connector sends its proof, HMAC-SHA256(secret, "connector" | both hellos
//      | both offers). The acceptor checks it and answers one byte: 0 (refused: PERMISSION_DENIED
//      on both ends, nothing more sent) or 1 followed by its own proof (the same with "acceptor").
//   3. The connector checks that proof and answers one byte, 1 or 0 (PERMISSION_DENIED on both
//      ends).
// A process without the secret thus learns only that it was refused: the acceptor's proof is sent
// only to a connector that proved itself first, and a connector's proof covers the acceptor's
// fresh nonce, so it is worth nothing on another connection. Proofs are compared in constant
// time. The secret authenticates the peers when the connection forms; the bytes the group moves
// afterwards are sealed only where the group seals its mesh (process_group.h, "encrypt"), under
// two keys derived here, one per direction: HMAC-SHA256(secret, a label of the direction | both
// hellos | both offers), never sent, fresh for every connection (its nonces).
//
// A process that refuses a peer says so in the message (naming `who`), never the secret.
#ifndef LOSSHEAD_KERNELS_COLLECTIVE_GROUP_AUTH_H_
#define LOSSHEAD_KERNELS_COLLECTIVE_GROUP_AUTH_H_

#include <cstddef>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/collective/mesh_cipher.h"
#include "kernels/collective/tcp.h"

namespace losshead::kernels {

// Runs the protocol above on `fd`. `secret`: this process's ("" for none). The hellos as sent
// (the connector's, then the acceptor's). OK when both ends hold the same secret or neither holds
// one; PERMISSION_DENIED when they differ (final: the peer got it too); the I/O error (UNAVAILABLE,
// DEADLINE_EXCEEDED by `deadline`) when the peer went away meanwhile (a retry may succeed).
// On OK with a secret, `keys` (when not null) gets this end's keys of the connection's two
// directions.
struct MeshKeys {
  MeshKey send;
  MeshKey receive;
};
absl::Status AuthenticatePeer(const tcp::Fd& fd, bool connector, absl::string_view secret,
                              std::span<const std::byte> connector_hello,
                              std::span<const std::byte> acceptor_hello, absl::string_view who,
                              absl::Time deadline, MeshKeys* keys = nullptr);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_COLLECTIVE_GROUP_AUTH_H_
