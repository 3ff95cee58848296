// The control plane of a head replicated across server processes (docs/multi-process.md): one
// process (rank 0) leads, and every request that changes what every process must hold alike
// (CreateHead, DeleteHead, SetLossOptions, SetOptimizer, PushWeights) or that cuts the gradient
// window (ApplyOptimizer, PullGradient) runs on every process in the leader's order. A
// follower's client request goes to the leader (ProcessControl.Lead); the leader numbers it and
// runs it on every process (ProcessControl.Apply to each follower, and here).
//
// Cuts and pushes run on every process at once: each enters its head's cut and the same exchanges
// of the group (ProcessWindow: the windows' sum; a push's W, from the process its client called
// to every other), so that the leader's one-at-a-time order is the order in which every process
// issues them. Other requests run on the leader first: a refusal there (deterministic, as every
// process holds the same state) is answered without touching the followers; then on every
// follower. A process that fails makes the request UNAVAILABLE naming it.
//
// A head sharded across processes (Placement.across_processes) is created on every process at
// once (its collective spans them) and its pulls and downloads are ordered by the leader like the
// cuts. Its micro-batches are numbered by the leader (their turns) and run on every process in
// that order, several in flight at once: each process stages the next ones while one runs
// (StepTurns), and the hidden states go from the origin's first shard to every other over the
// head's collective (NCCL between GPUs). Every other request waits at the leader for the
// micro-batches in flight to finish everywhere, and none is ordered meanwhile (Step).
//
// Steps of a replicated head need no control: each client id has a home process, HomeOf(client_id)
// = FNV-1a 64 of its bytes mod N, where its micro-batches are deduplicated; a micro-batch with a
// client id sent elsewhere is refused FAILED_PRECONDITION naming the home's address (CheckStep).
//
// Thread-safe.
#ifndef LOSSHEAD_SERVER_RPC_GROUP_CONTROL_H_
#define LOSSHEAD_SERVER_RPC_GROUP_CONTROL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "losshead/v1/losshead.pb.h"
#include "losshead/v1/process_control.grpc.pb.h"
#include "server/engine/head.h"
#include "server/engine/process_window.h"
#include "server/engine/step_turns.h"

namespace losshead::server {

struct ServiceContext;
class CheckpointSets;
class GroupSnapshots;

// The text of a redirect: "... home process <p> at <address> ..." ends with this marker and the
// address, so that clients can find it in the message ("home=<address>").
inline constexpr absl::string_view kHomeMarker = "home=";

class GroupControl {
 public:
  // `addresses`: every process's gRPC address, by rank. `op_timeout`: the group's, which bounds
  // how long a follower may take to answer the leader (twice it, plus a minute for allocation).
  GroupControl(std::shared_ptr<ProcessWindow> window, std::vector<std::string> addresses,
               absl::Duration op_timeout, ServiceContext* ctx);

  // How this process reaches its peers' gRPC ports, set before serving (default: plaintext, the
  // caller's token forwarded): `credentials` for the channels (TLS when the processes serve it);
  // `process_authorization`, the group's credential (GroupSecret::authorization()), sent on every
  // ProcessControl call instead of the caller's token ("": none, the caller's forwarded).
  void SetPeerSecurity(std::shared_ptr<grpc::ChannelCredentials> credentials,
                       std::string process_authorization);

  int rank() const { return window_->rank(); }
  int size() const { return window_->size(); }
  bool leader() const { return rank() == 0; }
  const std::vector<std::string>& addresses() const { return addresses_; }

  // FNV-1a 64 of the bytes of `client_id`, mod size().
  int HomeOf(absl::string_view client_id) const;
  // OK when `header`'s micro-batch may run here: one without a client id or forward-only runs
  // anywhere (nothing of it is remembered or counted); others only at their home
  // (FAILED_PRECONDITION naming it otherwise). UNAVAILABLE once the group is broken: its window
  // could never be cut.
  absl::Status CheckStep(const v1::StepHeader& header) const;

  // A request from a client of this process, run on every process (through the leader when this
  // is a follower). `authorization`: the caller's bearer header, forwarded ("" for none). A pull
  // leaves this process's copy of the group's gradient in `*pulled`.
  absl::StatusOr<v1::ControlResponse> Run(v1::ControlRequest request,
                                          const std::string& authorization,
                                          GradientSnapshot* pulled = nullptr);
  // The leader's part (its own clients' requests and ProcessControl.Lead).
  absl::StatusOr<v1::ControlResponse> Lead(v1::ControlRequest request,
                                           const std::string& authorization,
                                           GradientSnapshot* pulled);
  // A push of W received whole from a client of this process (`data`: V x D, then b, in the
  // header's dtype), broadcast to every process and pushed on each in the leader's order. The new
  // weights version, or the push's error (every process decides alike on the same bytes).
  absl::StatusOr<uint64_t> Push(const v1::PushHeader& header, std::string data,
                                const std::string& authorization);
  // A follower's part (ProcessControl.Apply): `request` run on this process's copy. A pull whose
  // origin is this process keeps its gradient for Run to take.
  absl::StatusOr<v1::ControlResponse> Apply(const v1::ControlRequest& request);

  // Checkpoints across processes (server/durability/group_checkpoint.h), before serving: `sets`
  // is this process's, `restored_cut` the set every process restored at start (0: none), after
  // which the leader numbers the next sets.
  void EnableCheckpoints(CheckpointSets* sets, uint64_t restored_cut);
  bool checkpoints() const { return sets_ != nullptr; }
  // A checkpoint of every head as one global cut, through the leader: every process writes its
  // part of the next set, and once all are written the leader writes the manifest (the set
  // exists from then on) and tells the followers (ProcessControl.Apply of checkpoint_commit).
  // `head` ("" or a head that must exist: NOT_FOUND) does not narrow it: a set holds every head.
  // The response lists every head with every process's clients. FAILED_PRECONDITION without
  // checkpoints; UNAVAILABLE when a process failed (the set is not complete; no manifest).
  absl::StatusOr<v1::CheckpointResponse> Checkpoint(const std::string& head,
                                                    const std::string& authorization);

  // Named snapshots of one head across processes (server/rpc/group_snapshot.cc,
  // server/durability/group_snapshots.h), before serving: `snapshots` is this process's. Each is
  // one request through the leader; a take, restore or delete runs on every process at once, and
  // a refusal anywhere (after the leader's own checks: the head, the tag's manifest) is every
  // process's, with its code (Agree). FAILED_PRECONDITION without checkpoints.
  void EnableSnapshots(GroupSnapshots* snapshots) { snapshots_ = snapshots; }
  // Every process writes its part of `head`'s snapshot `tag`; once all are written the leader
  // writes the manifest, and the snapshot exists. NOT_FOUND for an unknown head, ALREADY_EXISTS
  // for a tag the head has (a replacement could not be atomic across hosts: delete it first);
  // a process that fails makes it fail with no manifest (and its parts removed where possible).
  absl::StatusOr<v1::SnapshotInfo> TakeSnapshot(const std::string& head, const std::string& tag,
                                                const std::string& authorization);
  // Every process checks its part against the leader's manifest, they agree, and every process
  // puts its part in the place of its head (HeadRegistry::Restore) only once every one has built
  // it; then the leader takes a checkpoint set, so that a restart comes back to the restored
  // state. NOT_FOUND for a missing snapshot or part, DATA_LOSS for a damaged one: on every
  // process alike, nothing changed anywhere. The head's HeadInfo here.
  absl::StatusOr<v1::HeadInfo> RestoreSnapshot(const std::string& head, const std::string& tag,
                                               const std::string& authorization);
  // Every process checks its part is there, they agree, the leader removes the manifest and then
  // every process its part. NOT_FOUND (a missing snapshot, or a part missing anywhere: nothing
  // removed) on every process alike.
  absl::Status DeleteSnapshot(const std::string& head, const std::string& tag,
                              const std::string& authorization);
  // The snapshots of `head` (which need not exist), by tag, from the leader's manifests.
  absl::StatusOr<std::vector<v1::SnapshotInfo>> ListSnapshots(const std::string& head,
                                                              const std::string& authorization);

  // Orderly shutdown of a group with checkpoints (server.cc's Shutdown, once this process's
  // clients are drained; group_shutdown.cc): tells the leader this process is stopping and waits,
  // until `deadline`, for the final checkpoint set, which the leader takes once every process is
  // stopping (every process's answered micro-batches are in it). OK: the set is complete.
  // DEADLINE_EXCEEDED when not every process was stopping by then (no final set: a process
  // stopping alone leaves, its group breaks, and a restart comes back to the last complete set);
  // the set's error otherwise (a broken group takes none: UNAVAILABLE).
  absl::Status Leave(absl::Time deadline);

  // Whether process `process` answers (ProcessControl.Members, without a token: any answer, a
  // refusal included, is a live process) within `timeout`: OK, or UNAVAILABLE naming it.
  absl::Status Probe(int process, absl::Duration timeout);
  // OK while the group's exchanges work; the error that broke it otherwise.
  absl::Status health() const { return window_->health(); }
  // A micro-batch of a head sharded across processes (Head::across_processes), received whole
  // by this process (its home, for one with a client id: CheckStep): a replay is answered here
  // (Head::ClaimStep); otherwise the leader gives it its turn among every process's micro-batches
  // and behind every request ordered before it, its targets and per-token inputs go to every
  // process with the order, and every process runs it (Head::RunStep) in turn, its hidden states
  // coming from this process's first shard in the run. The outcome is this process's run's.
  // UNAVAILABLE when the group failed before it ran here (nothing counted here, the key free
  // again) or while it ran (the key keeps that answer). `on_ordered`, when given, is called once
  // its turn is fixed (as Head::Step's once it holds its devices): a stream sends its next
  // micro-batch then, which gets a later turn, so that several of one stream are in flight.
  absl::StatusOr<std::shared_ptr<const StepOutcome>> Step(
      Head& head, const MicroBatch& microbatch, StepStats* stats, const std::string& authorization,
      const std::function<void()>& on_ordered = nullptr);

 private:
  // The leader's part of a micro-batch of a head sharded across processes: numbered under
  // lead_mu_, then run on every process without it, so that the next ones are ordered and staged
  // while it runs.
  absl::StatusOr<v1::ControlResponse> LeadStep(v1::ControlRequest request,
                                               const std::string& authorization);
  // The leader's part of a checkpoint, under lead_mu_.
  absl::StatusOr<v1::ControlResponse> LeadCheckpoint(v1::ControlRequest request,
                                                     const std::string& authorization)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lead_mu_);
  // The leader's part of Leave: `process` is stopping; waits until every process is, then takes
  // the final set (once), or until `deadline`. Not under lead_mu_ (it waits).
  absl::Status AwaitFinalSet(int process, absl::Time deadline);
  // The leader's part of a named snapshot's request, under lead_mu_ (group_snapshot.cc).
  absl::StatusOr<v1::ControlResponse> LeadSnapshot(v1::ControlRequest request,
                                                   const std::string& authorization)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lead_mu_);
  // `request` run here and on every follower at once: this process's answer, then each
  // follower's by rank (index 0 unused).
  std::pair<absl::StatusOr<v1::ControlResponse>, std::vector<absl::StatusOr<v1::ControlResponse>>>
  RunEverywhere(const v1::ControlRequest& request, const std::string& authorization)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lead_mu_);
  // A named snapshot's request run on this process's part (RunHere's case).
  absl::StatusOr<v1::ControlResponse> RunSnapshot(const v1::ControlRequest& request);
  // Whether `request` deletes a head sharded across processes: run on every process at once,
  // as a cut is, since the head's collective (NCCL's communicators) is torn down by every
  // process together; the leader's alone would wait for followers not yet told.
  bool DeletesHeadAcrossProcesses(const v1::ControlRequest& request) const;
  // `request` run here; a pull's gradient to `*pulled`.
  absl::StatusOr<v1::ControlResponse> RunHere(const v1::ControlRequest& request,
                                              GradientSnapshot* pulled);
  // ProcessControl.Apply on every follower, in parallel; their answers by rank (index 0 unused).
  std::vector<absl::StatusOr<v1::ControlResponse>> ApplyOnFollowers(
      const v1::ControlRequest& request, const std::string& authorization);
  v1::ProcessControl::Stub& StubOf(int process);
  // The credential a ProcessControl call to a peer carries: the group's, or else the caller's.
  void Authenticate(grpc::ClientContext& context, const std::string& authorization) const;
  // Every process's `mine` exchanged over the group: OK when every one is OK, otherwise the
  // first refusal in rank order (another process's named), the same on every process.
  absl::Status Agree(absl::string_view what, const absl::Status& mine);
  // CreateHead of a head sharded across processes: every process at once, refusing alike.
  absl::StatusOr<std::shared_ptr<Head>> CreateAcross(const v1::HeadSpec& spec);
  absl::Duration CallTimeout() const { return op_timeout_ * 2 + absl::Minutes(1); }

  const std::shared_ptr<ProcessWindow> window_;
  const std::vector<std::string> addresses_;
  const absl::Duration op_timeout_;
  ServiceContext* const ctx_;

  // Set before serving (SetPeerSecurity), read-only afterwards.
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials_;
  std::string process_authorization_;

  absl::Mutex stubs_mu_;
  std::map<int, std::unique_ptr<v1::ProcessControl::Stub>> stubs_ ABSL_GUARDED_BY(stubs_mu_);
  // The leader: one request at a time, numbered in order.
  absl::Mutex lead_mu_;
  uint64_t sequence_ ABSL_GUARDED_BY(lead_mu_) = 0;
  // The last micro-batch's turn, the micro-batches ordered and not yet run everywhere, and the
  // requests waiting for them to finish (which no new micro-batch overtakes).
  uint64_t turn_ ABSL_GUARDED_BY(lead_mu_) = 0;
  int steps_in_flight_ ABSL_GUARDED_BY(lead_mu_) = 0;
  int draining_ ABSL_GUARDED_BY(lead_mu_) = 0;
  // The last checkpoint set's number (the leader's).
  uint64_t cut_ ABSL_GUARDED_BY(lead_mu_) = 0;
  // Null without checkpoints; set before serving.
  CheckpointSets* sets_ = nullptr;
  GroupSnapshots* snapshots_ = nullptr;
  // The leader: the processes stopping in order, and the final set once taken.
  absl::Mutex leave_mu_;
  std::vector<bool> leaving_ ABSL_GUARDED_BY(leave_mu_);
  bool final_started_ ABSL_GUARDED_BY(leave_mu_) = false;
  bool final_done_ ABSL_GUARDED_BY(leave_mu_) = false;
  absl::Status final_ ABSL_GUARDED_BY(leave_mu_);
  // A follower: the last sequence it ran (requests come in increasing order), and the pulls
  // whose origin it is, until their caller takes them.
  absl::Mutex mu_;
  uint64_t applied_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, GradientSnapshot> pulled_ ABSL_GUARDED_BY(mu_);
  // The pushes whose origin this process is, until their broadcast.
  uint64_t next_push_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::string> pushes_ ABSL_GUARDED_BY(mu_);
  // The micro-batches whose origin this process is, until the leader has run them: what the
  // run needs here and what it answered.
  struct PendingStep {
    const MicroBatch* microbatch = nullptr;
    StepStats* stats = nullptr;
    const std::function<void()>* on_ordered = nullptr;
    bool ran = false;
    absl::StatusOr<std::shared_ptr<const StepOutcome>> outcome{absl::UnknownError("not run")};
  };
  uint64_t next_step_ ABSL_GUARDED_BY(mu_) = 0;
  // Where this process's runs of those micro-batches wait for their turns.
  StepTurns turns_;
  std::map<uint64_t, PendingStep*> steps_ ABSL_GUARDED_BY(mu_);
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_GROUP_CONTROL_H_
