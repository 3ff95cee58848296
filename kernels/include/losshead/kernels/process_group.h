// A process group: the server processes (on one host or several) that hold one head together, each
// knowing its process rank, the number of processes and where every process's collective endpoint
// listens. It is what a Collective spanning processes runs over (CreateProcessCollective): the host
// implementation moves the data through the group's TCP connections, NCCL uses the group only to
// hand out its unique id.
//
// Membership is static and by address: process p listens on peers[p] and every process is given
// the whole list, which suits a StatefulSet's stable names (ExpandPeerPattern: "head-{}.head:7070"
// for head-0.head:7070, head-1.head:7070, ...; the rank from the pod's name, RankFromHostname).
// Bootstrap makes a full mesh: process p connects to every lower rank (retrying while a peer is not
// up yet or its name does not resolve yet) and accepts every higher one; both ends of a connection
// exchange a hello (protocol version, world size, rank, group name) and check it; then, where the
// processes hold a group secret, each end proves to the other that it holds the same one
// (kernels/collective/group_auth.h: HMAC-SHA256 over both ends' fresh nonces, the higher rank
// first, so that a process without it learns nothing but its refusal). With `encrypt`, every
// exchange afterwards goes sealed (kernels/collective/mesh_cipher.h: AES-256-GCM records under
// two keys per connection, one per direction, derived from the secret and the connection's fresh
// nonces): what the group moves can be neither read nor altered, replayed or reordered on the
// network unnoticed. A record that fails its tag breaks the group as a closed connection does.
//
// Errors: bootstrap that does not finish by options.bootstrap_timeout is DEADLINE_EXCEEDED naming
// the processes (and addresses) that never came; a hello whose version, world size, group name or
// rank disagrees, or a peer that seals the mesh beside one that does not, is FAILED_PRECONDITION
// naming both values, on both ends; a peer that holds
// another secret, or none where this process holds one (or one where this process holds none), is
// PERMISSION_DENIED on both ends, before it is given its rank; a peer that goes away
// during bootstrap is tried again until the deadline; malformed options are INVALID_ARGUMENT.
//
// Failure contract: every exchange has a deadline (options.op_timeout, for the whole exchange:
// set it well above the time the largest transfer takes). A peer that closes its connection (its
// process died: the kernel closes a killed process's sockets) or has not finished its part by the
// deadline (stopped, partitioned, or not calling) makes the exchange UNAVAILABLE naming it, and
// the group is broken from then on: every later exchange, on every thread, is UNAVAILABLE at once
// without touching any socket. A broken group is never repaired; the layer above builds a new one
// (a fresh bootstrap, with a new group name or generation) after restoring its state from a
// checkpoint. The group does not interpret the bytes: callers that disagree on what to exchange
// are the collectives' to detect (they compare a header first, and keep the group usable).
//
// Thread-safe: exchanges are serialised, one whole exchange at a time, so every process must issue
// the same sequence of exchanges (as of collective calls).
#ifndef LOSSHEAD_KERNELS_PROCESS_GROUP_H_
#define LOSSHEAD_KERNELS_PROCESS_GROUP_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"

namespace losshead::kernels {

// Version of the group's wire protocol; processes of different versions refuse each other.
// 2: the group secret's check after the hello. 3: the hello says whether the mesh is sealed.
inline constexpr uint32_t kProcessGroupProtocolVersion = 3;

struct ProcessGroupOptions {
  int rank = 0;   // this process, in [0, peers.size())
  int world = 0;  // the number of processes; must equal peers.size()
  // "host:port" of every process's endpoint, indexed by process rank ("[v6addr]:port" for IPv6).
  std::vector<std::string> peers;
  // Where this process listens: "host:port", ":port" (every address), or empty for every address
  // on the port of peers[rank].
  std::string listen;
  // Processes of different groups never join each other: the head's name and a generation that
  // the layer above bumps at every rebuild, for instance.
  std::string group_name = "losshead";
  absl::Duration bootstrap_timeout = absl::Seconds(120);
  absl::Duration op_timeout = absl::Seconds(60);
  // The group secret every process must hold to join (at least 16 bytes; empty: none, and then
  // no process may hold one). It authenticates the peers at bootstrap; what the group moves later
  // is sealed only with `encrypt`, else it travels in the clear (the endpoints then belong on a
  // private network).
  std::string secret;
  // Seal every exchange (see above); needs `secret`, and every process of the group must agree.
  bool encrypt = false;
};

// "name-{}.svc:port" with {} replaced by 0, ..., world - 1. INVALID_ARGUMENT unless the pattern
// holds exactly one {} and world >= 1.
absl::StatusOr<std::vector<std::string>> ExpandPeerPattern(absl::string_view pattern, int world);

// The ordinal a StatefulSet appends to its pods' names: 3 for "losshead-3" (or "losshead-3.x.y").
// INVALID_ARGUMENT for a name that does not end in "-<digits>" before its first dot.
absl::StatusOr<int> RankFromHostname(absl::string_view hostname);

class ProcessGroup {
 public:
  // Bootstraps the group: returns once connected to every other process, or the error above.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> Create(const ProcessGroupOptions& options);

  ~ProcessGroup();  // Shutdown()
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(peers_.size()); }
  const std::string& peer(int rank) const { return peers_[rank]; }
  absl::Duration op_timeout() const { return op_timeout_; }

  // One round of point-to-point transfers with every other process at once: sends[q] goes to
  // process q and recvs[q] is filled from it (both ignored for q == rank()); every byte count must
  // be what the peer sends or expects, which is the callers' protocol. OK once all of it moved;
  // UNAVAILABLE (breaking the group) on a peer's close, an I/O error or the deadline;
  // UNAVAILABLE at once when the group is already broken or shut down. `what` names the exchange
  // in errors.
  absl::Status Exchange(absl::string_view what, std::span<const std::span<const std::byte>> sends,
                        std::span<const std::span<std::byte>> recvs);

  // Every process's `mine` (all of the same length), indexed by process rank.
  absl::StatusOr<std::vector<std::vector<std::byte>>> AllGather(absl::string_view what,
                                                                std::span<const std::byte> mine);

  // OK while the group can exchange; the error that broke it otherwise.
  absl::Status health() const;

  // Closes every connection: later exchanges are UNAVAILABLE here, and the peers see this process
  // leave (their exchanges in flight or to come are UNAVAILABLE). Idempotent.
  void Shutdown();

 private:
  ProcessGroup(int rank, std::vector<std::string> peers, std::vector<int> fds,
               absl::Duration op_timeout);
  absl::Status Break(absl::Status status);

  struct State;
  const int rank_;
  const std::vector<std::string> peers_;
  const absl::Duration op_timeout_;
  std::unique_ptr<State> state_;
};

// Every process's `mine`, by rank, through one AllGather of `group` (a collective call): what lets
// every process of a group take a decision that any one of them refused, each learning the
// refusing process's code and reason. Messages are cut to about 1 KiB.
absl::StatusOr<std::vector<absl::Status>> GatherStatuses(ProcessGroup& group,
                                                         absl::string_view what,
                                                         const absl::Status& mine);

// The collective whose ranks are the local backends of every process of `group`: process p's ranks
// come after those of processes 0, ..., p - 1, in the order given here. A collective call: every
// process of the group calls it, and the group's processes may give different numbers of
// backends (at least one each). All backends of all processes must be CPU backends (the host
// implementation over the group's TCP connections) or all CUDA backends on distinct devices of
// their host (NCCL, one communicator per local device, initialised with ncclCommInitRank from a
// unique id made by global rank 0 and handed out through the group; NVLink multicast stays off).
//
// The calls keep Collective's contract, and the host implementation gives the same bits as the
// one-process host collective over the same global ranks: each element is reduced by one process
// from every rank's value in fp64, in global rank order, and rounded once. Before data moves,
// every call compares a header (call, sequence number, dtype, op, root, counts) with every peer:
// processes that called different things get FAILED_PRECONDITION naming the disagreement, with
// nothing touched, and the group stays usable. A call that one process refused locally
// (INVALID_ARGUMENT) is not sent: its peers wait for it and their call ends UNAVAILABLE at the
// group's op timeout, breaking the group. A call with nothing to move (zero elements) is not
// exchanged either.
//
// The group is shared: it outlives the collective (and several collectives may use one group, as
// long as every process issues their calls in the same order). The backends are referred to.
// INVALID_ARGUMENT for no backends, a null one, or a mix of kinds here; FAILED_PRECONDITION when
// the processes' kinds differ; UNIMPLEMENTED for CUDA backends in a build without NCCL; the
// group's errors (UNAVAILABLE) when it fails during creation.
absl::StatusOr<std::unique_ptr<Collective>> CreateProcessCollective(
    std::shared_ptr<ProcessGroup> group, std::span<Backend* const> backends);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_PROCESS_GROUP_H_
