#include "server/rpc/group_control.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "server/durability/group_checkpoint.h"
#include "server/engine/head_registry.h"
#include "server/engine/step_turns.h"
#include "server/rpc/service_context.h"
#include "server/rpc/status_util.h"

namespace losshead::server {
namespace {

// What every process runs at once, meeting in an exchange of the group.
bool IsCut(const v1::ControlRequest& request) {
  // A head sharded across processes: its creation (the collective joins every process), its
  // downloads and embedding rows (every process sends its rows) too; its micro-batches go by
  // turns (LeadStep).
  const bool across =
      request.has_create_head() && request.create_head().spec().placement().across_processes();
  return request.has_apply_optimizer() || request.has_pull_gradient() ||
         request.has_push_weights() || request.has_download_weights() ||
         request.has_embedding_rows() || across;
}

// The micro-batch's targets and per-token inputs one after another, as StepControl counts them
// (its hidden states go over the head's collective in the run).
std::string PackTensors(const MicroBatch& mb) {
  std::string packed(mb.targets);
  for (const std::string& input : mb.token_inputs) packed.append(input);
  return packed;
}

absl::Status UnpackTensors(const v1::StepControl& step, MicroBatch* mb) {
  const std::string& packed = step.tensors();
  size_t at = 0;
  auto take = [&](uint64_t bytes, std::string* into) {
    if (bytes > packed.size() - at) return false;
    into->assign(packed, at, bytes);
    at += bytes;
    return true;
  };
  bool whole = take(step.targets_bytes(), &mb->targets);
  if (step.token_input_bytes_size() > kTokenInputs) whole = false;
  for (int i = 0; whole && i < step.token_input_bytes_size(); ++i) {
    whole = take(step.token_input_bytes(i), &mb->token_inputs[i]);
  }
  if (!whole || at != packed.size()) {
    return absl::InternalError("a micro-batch's tensors arrived with other sizes than announced");
  }
  mb->header = step.header();
  mb->hidden_elsewhere = true;
  mb->hidden_max_abs = step.hidden_max_abs();
  return absl::OkStatus();
}

// What a follower's status becomes in the leader's answer: the follower's code and message,
// named, except where it could not be reached or answered nothing (UNAVAILABLE).
absl::Status FromFollower(int process, const std::string& address, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("process ", process, " (", address,
                                                  ") of the group: ", status.message()));
}

}  // namespace

GroupControl::GroupControl(std::shared_ptr<ProcessWindow> window,
                           std::vector<std::string> addresses, absl::Duration op_timeout,
                           ServiceContext* ctx)
    : window_(std::move(window)),
      addresses_(std::move(addresses)),
      op_timeout_(op_timeout),
      ctx_(ctx),
      turns_(op_timeout * 2 + absl::Minutes(1)) {}

int GroupControl::HomeOf(absl::string_view client_id) const {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : client_id) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return static_cast<int>(hash % static_cast<uint64_t>(size()));
}

absl::Status GroupControl::CheckStep(const v1::StepHeader& header) const {
  if (absl::Status health = window_->health(); !health.ok()) {
    return absl::UnavailableError(
        absl::StrCat("the head's process group is broken (", health.message(),
                     "): its gradient window can no longer be cut; the group must be rebuilt"));
  }
  if (header.client_id().empty() || header.options().forward_only()) return absl::OkStatus();
  const int home = HomeOf(header.client_id());
  if (home == rank()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("client '", header.client_id(), "' has its home on process ", home, " of ",
                   size(), ", not on this one (process ", rank(), "): send its micro-batches to ",
                   addresses_[home], " (", kHomeMarker, addresses_[home], ")"));
}

v1::ProcessControl::Stub& GroupControl::StubOf(int process) {
  absl::MutexLock lock(&stubs_mu_);
  std::unique_ptr<v1::ProcessControl::Stub>& stub = stubs_[process];
  if (stub == nullptr) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    stub = v1::ProcessControl::NewStub(grpc::CreateCustomChannel(
        addresses_[process],
        peer_credentials_ != nullptr ? peer_credentials_ : grpc::InsecureChannelCredentials(),
        args));
  }
  return *stub;
}

void GroupControl::SetPeerSecurity(std::shared_ptr<grpc::ChannelCredentials> credentials,
                                   std::string process_authorization) {
  peer_credentials_ = std::move(credentials);
  process_authorization_ = std::move(process_authorization);
}

void GroupControl::Authenticate(grpc::ClientContext& context,
                                const std::string& authorization) const {
  // The group's credential, where there is one: a client's token then never leaves the process
  // its client called, and the leader's own requests (its periodic sets) need none.
  const std::string& sent = process_authorization_.empty() ? authorization : process_authorization_;
  if (!sent.empty()) context.AddMetadata("authorization", sent);
}

absl::Status GroupControl::Probe(int process, absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  Authenticate(context, "");
  v1::MembersResponse members;
  const grpc::Status status = StubOf(process).Members(&context, v1::MembersRequest(), &members);
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::UnavailableError(absl::StrCat("process ", process, " (", addresses_[process],
                                               ") does not answer: ", status.error_message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ControlResponse> GroupControl::Run(v1::ControlRequest request,
                                                      const std::string& authorization,
                                                      GradientSnapshot* pulled) {
  request.set_origin(rank());
  if (leader()) return Lead(std::move(request), authorization, pulled);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + CallTimeout()));
  Authenticate(context, authorization);
  v1::ControlResponse response;
  const grpc::Status status = StubOf(0).Lead(&context, request, &response);
  if (!status.ok()) {
    // The leader's answer as it is, except where the group is not there (unreachable, too slow,
    // broken): UNAVAILABLE, saying through whom.
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
        status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      return absl::UnavailableError(absl::StrCat("through the group's leader (process 0 at ",
                                                 addresses_[0], "): ", status.error_message()));
    }
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  if ((request.has_pull_gradient() || request.has_download_weights() ||
       request.has_embedding_rows()) &&
      pulled != nullptr) {
    absl::MutexLock lock(&mu_);
    auto it = pulled_.find(response.sequence());
    if (it == pulled_.end()) {
      return absl::InternalError(absl::StrCat("the pull of cut ", response.sequence(),
                                              " left no gradient on this process"));
    }
    *pulled = std::move(it->second);
    pulled_.erase(it);
  }
  return response;
}

absl::StatusOr<uint64_t> GroupControl::Push(const v1::PushHeader& header, std::string data,
                                            const std::string& authorization) {
  v1::ControlRequest request;
  v1::PushControl& push = *request.mutable_push_weights();
  *push.mutable_header() = header;
  push.set_bytes(data.size());
  {
    absl::MutexLock lock(&mu_);
    push.set_push_id(++next_push_);
    pushes_[push.push_id()] = std::move(data);
  }
  absl::StatusOr<v1::ControlResponse> done = Run(request, authorization);
  {
    absl::MutexLock lock(&mu_);
    pushes_.erase(push.push_id());  // still here when the leader refused it before the broadcast
  }
  if (!done.ok()) return done.status();
  return done->weights_version();
}

std::vector<absl::StatusOr<v1::ControlResponse>> GroupControl::ApplyOnFollowers(
    const v1::ControlRequest& request, const std::string& authorization) {
  std::vector<absl::StatusOr<v1::ControlResponse>> answers(size(), v1::ControlResponse());
  std::vector<std::thread> calls;
  for (int p = 1; p < size(); ++p) {
    calls.emplace_back([&, p] {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + CallTimeout()));
      Authenticate(context, authorization);
      v1::ControlResponse response;
      const grpc::Status status = StubOf(p).Apply(&context, request, &response);
      if (status.ok()) {
        answers[p] = std::move(response);
      } else {
        const absl::StatusCode code = status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                                          ? absl::StatusCode::kUnavailable
                                          : static_cast<absl::StatusCode>(status.error_code());
        answers[p] = FromFollower(p, addresses_[p], absl::Status(code, status.error_message()));
      }
    });
  }
  for (std::thread& t : calls) t.join();
  return answers;
}

void GroupControl::EnableCheckpoints(CheckpointSets* sets, uint64_t restored_cut) {
  absl::MutexLock lock(&lead_mu_);
  sets_ = sets;
  cut_ = restored_cut;
}

absl::StatusOr<v1::CheckpointResponse> GroupControl::Checkpoint(const std::string& head,
                                                                const std::string& authorization) {
  if (sets_ == nullptr) {
    return absl::FailedPreconditionError("checkpoints are disabled (no --checkpoint_dir)");
  }
  if (!head.empty()) LOSSHEAD_RETURN_IF_ERROR(ctx_->registry->Get(head).status());
  v1::ControlRequest request;
  request.mutable_checkpoint()->set_head(head);
  LOSSHEAD_ASSIGN_OR_RETURN(v1::ControlResponse response, Run(std::move(request), authorization));
  return std::move(*response.mutable_checkpoint());
}

absl::StatusOr<v1::ControlResponse> GroupControl::LeadCheckpoint(v1::ControlRequest request,
                                                                 const std::string& authorization) {
  if (sets_ == nullptr) {
    return absl::FailedPreconditionError("checkpoints are disabled (no --checkpoint_dir)");
  }
  const uint64_t cut = ++cut_;  // never reused: a failed set's parts are pruned later
  request.mutable_checkpoint()->set_cut(cut);
  // Every process writes its part at once; they exchange nothing, and no other control request
  // runs meanwhile (lead_mu_), so every part lies between the same two cuts of the window.
  absl::StatusOr<v1::ControlResponse> mine;
  std::thread local([&] { mine = RunHere(request, nullptr); });
  std::vector<absl::StatusOr<v1::ControlResponse>> answers =
      ApplyOnFollowers(request, authorization);
  local.join();
  absl::Status failed = mine.status();
  for (int p = 1; p < size() && failed.ok(); ++p) failed = answers[p].status();
  if (!failed.ok()) {
    sets_->Abandon(cut);
    // No manifest: the set does not exist, whatever parts were written.
    return absl::Status(failed.code() == absl::StatusCode::kDeadlineExceeded
                            ? absl::StatusCode::kUnavailable
                            : failed.code(),
                        absl::StrCat("checkpoint set ", cut, " not taken: ", failed.message()));
  }
  v1::CheckpointManifest manifest;
  manifest.set_cut(cut);
  manifest.set_processes(size());
  manifest.set_unix_time(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  v1::ControlResponse merged = *std::move(mine);
  *manifest.add_parts() = merged.part();
  for (int p = 1; p < size(); ++p) {
    *manifest.add_parts() = answers[p]->part();
    // Each head's window and clients as the group holds them: every part's.
    for (const v1::HeadCheckpoint& theirs : answers[p]->checkpoint().heads()) {
      for (v1::HeadCheckpoint& ours : *merged.mutable_checkpoint()->mutable_heads()) {
        if (ours.head() != theirs.head()) continue;
        ours.set_microbatches_since_pull(ours.microbatches_since_pull() +
                                         theirs.microbatches_since_pull());
        ours.set_bytes(ours.bytes() + theirs.bytes());
        ours.set_write_seconds(std::max(ours.write_seconds(), theirs.write_seconds()));
        for (const v1::ClientProgress& c : theirs.clients()) *ours.add_clients() = c;
      }
    }
  }
  if (absl::Status written = sets_->WriteManifest(manifest); !written.ok()) {
    return absl::Status(
        written.code(),
        absl::StrCat("checkpoint set ", cut, " not taken: its manifest: ", written.message()));
  }
  // The set exists. The followers record it; one that does not hear it still holds its part,
  // which the next start checks against this manifest.
  v1::ControlRequest commit;
  commit.set_sequence(++sequence_);
  commit.set_origin(rank());
  commit.mutable_checkpoint_commit()->set_cut(cut);
  std::vector<absl::StatusOr<v1::ControlResponse>> acks = ApplyOnFollowers(commit, authorization);
  for (int p = 1; p < size(); ++p) {
    if (!acks[p].ok()) {
      std::fprintf(stderr,
                   "losshead-server: checkpoint set %llu is complete, but process %d did "
                   "not record it: %s\n",
                   static_cast<unsigned long long>(cut), p, acks[p].status().ToString().c_str());
    }
  }
  merged.clear_part();
  return merged;
}

bool GroupControl::DeletesHeadAcrossProcesses(const v1::ControlRequest& request) const {
  if (!request.has_delete_head()) return false;
  absl::StatusOr<std::shared_ptr<Head>> head = ctx_->registry->Get(request.delete_head().name());
  return head.ok() && (*head)->across_processes();
}

absl::StatusOr<v1::ControlResponse> GroupControl::LeadStep(v1::ControlRequest request,
                                                           const std::string& authorization) {
  {
    absl::MutexLock lock(&lead_mu_);
    // Behind any request waiting for the micro-batches in flight to finish.
    lead_mu_.Await(absl::Condition(
        +[](int* draining) { return *draining == 0; }, &draining_));
    LOSSHEAD_RETURN_IF_ERROR(window_->health());
    request.set_sequence(++sequence_);
    request.mutable_step()->set_turn(++turn_);
    ++steps_in_flight_;
  }
  // Every process at once, in turn order (StepTurns); the next micro-batch is ordered meanwhile.
  absl::StatusOr<v1::ControlResponse> mine;
  std::thread local([&] { mine = RunHere(request, nullptr); });
  std::vector<absl::StatusOr<v1::ControlResponse>> answers =
      ApplyOnFollowers(request, authorization);
  local.join();
  {
    absl::MutexLock lock(&lead_mu_);
    --steps_in_flight_;
  }
  if (!mine.ok()) return mine.status();
  for (int p = 1; p < size(); ++p) {
    if (!answers[p].ok()) return answers[p].status();
  }
  return mine;
}

absl::StatusOr<v1::ControlResponse> GroupControl::Lead(v1::ControlRequest request,
                                                       const std::string& authorization,
                                                       GradientSnapshot* pulled) {
  if (request.has_step()) return LeadStep(std::move(request), authorization);
  if (request.has_leaving()) {
    // Waits for the other processes to stop: outside the leader's order.
    LOSSHEAD_RETURN_IF_ERROR(AwaitFinalSet(request.leaving().rank(), absl::Now() + CallTimeout()));
    return v1::ControlResponse();
  }
  absl::MutexLock lock(&lead_mu_);
  // Every other request sees the group as the micro-batches ordered before it left it: those in
  // flight finish first (on every process), and no other is ordered until this one is done.
  ++draining_;
  lead_mu_.Await(absl::Condition(
      +[](int* in_flight) { return *in_flight == 0; }, &steps_in_flight_));
  --draining_;
  LOSSHEAD_RETURN_IF_ERROR(window_->health());
  request.set_sequence(++sequence_);
  if (request.has_checkpoint()) return LeadCheckpoint(std::move(request), authorization);
  if (request.has_snapshot()) return LeadSnapshot(std::move(request), authorization);
  // The origin's gradient: kept here when the origin is the leader, by the origin otherwise.
  GradientSnapshot own;
  GradientSnapshot* here = request.origin() == rank() ? pulled : &own;
  if (IsCut(request) || DeletesHeadAcrossProcesses(request)) {
    // Every process at once: they meet in the cut's collectives.
    absl::StatusOr<v1::ControlResponse> mine;
    std::thread local([&] { mine = RunHere(request, here); });
    std::vector<absl::StatusOr<v1::ControlResponse>> answers =
        ApplyOnFollowers(request, authorization);
    local.join();
    if (!mine.ok()) return mine.status();
    for (int p = 1; p < size(); ++p) {
      if (!answers[p].ok()) return answers[p].status();
    }
    return mine;
  }
  // The leader first: what it refuses, every process would (they hold the same state).
  LOSSHEAD_ASSIGN_OR_RETURN(v1::ControlResponse mine, RunHere(request, here));
  std::vector<absl::StatusOr<v1::ControlResponse>> answers =
      ApplyOnFollowers(request, authorization);
  for (int p = 1; p < size(); ++p) {
    if (!answers[p].ok()) {
      // The processes no longer hold the same state: say so, with the follower's error.
      return absl::UnavailableError(absl::StrCat(
          "applied on the leader but not on every process, so the group's copies differ: ",
          answers[p].status().message()));
    }
  }
  return mine;
}

absl::StatusOr<v1::ControlResponse> GroupControl::Apply(const v1::ControlRequest& request) {
  // Micro-batches are ordered by their turns (several are in flight at once, and their calls may
  // arrive in another order); everything else waits for them at the leader.
  if (!request.has_step()) {
    absl::MutexLock lock(&mu_);
    if (request.sequence() <= applied_) {
      return absl::FailedPreconditionError(absl::StrCat("control request ", request.sequence(),
                                                        " arrived after request ", applied_,
                                                        ": the leader's order is broken"));
    }
    applied_ = request.sequence();
  }
  GradientSnapshot pulled;
  LOSSHEAD_ASSIGN_OR_RETURN(v1::ControlResponse response, RunHere(request, &pulled));
  if ((request.has_pull_gradient() || request.has_download_weights() ||
       request.has_embedding_rows()) &&
      request.origin() == rank()) {
    absl::MutexLock lock(&mu_);
    pulled_[request.sequence()] = std::move(pulled);
  }
  return response;
}

absl::StatusOr<v1::ControlResponse> GroupControl::RunHere(const v1::ControlRequest& request,
                                                          GradientSnapshot* pulled) {
  v1::ControlResponse response;
  response.set_sequence(request.sequence());
  GradientSnapshot unwanted;  // a pull whose gradient nobody here asked for
  if (pulled == nullptr) pulled = &unwanted;
  HeadRegistry& registry = *ctx_->registry;
  switch (request.op_case()) {
    case v1::ControlRequest::kCreateHead: {
      const v1::HeadSpec& spec = request.create_head().spec();
      LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, spec.placement().across_processes()
                                                                ? CreateAcross(spec)
                                                                : registry.Create(spec));
      *response.mutable_head() = head->Info();
      break;
    }
    case v1::ControlRequest::kDeleteHead:
      LOSSHEAD_RETURN_IF_ERROR(registry.Delete(request.delete_head().name()));
      ctx_->metrics->RemoveHead(request.delete_head().name());
      ctx_->metrics->Heads(registry.size());
      break;
    case v1::ControlRequest::kSetLossOptions: {
      LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head,
                                registry.Get(request.set_loss_options().name()));
      LOSSHEAD_RETURN_IF_ERROR(
          head->SetDefaultOptions(request.set_loss_options().default_options()));
      *response.mutable_head() = head->Info();
      break;
    }
    case v1::ControlRequest::kSetOptimizer: {
      LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head,
                                registry.SetOptimizer(request.set_optimizer().head(),
                                                      request.set_optimizer().optimizer()));
      *response.mutable_head() = head->Info();
      break;
    }
    case v1::ControlRequest::kApplyOptimizer: {
      LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head,
                                registry.Get(request.apply_optimizer().head()));
      LOSSHEAD_ASSIGN_OR_RETURN(*response.mutable_apply_optimizer(),
                                head->ApplyOptimizer(request.apply_optimizer()));
      break;
    }
    case v1::ControlRequest::kPullGradient: {
      const v1::PullGradientRequest& pull = request.pull_gradient();
      LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, registry.Get(pull.head()));
      if (pull.summary_only()) {
        LOSSHEAD_ASSIGN_OR_RETURN(*response.mutable_summary(),
                                  head->WindowSummary(pull.dtype(), pull.reset()));
        pulled->summary = response.summary();
        pulled->data.clear();
      } else {
        LOSSHEAD_ASSIGN_OR_RETURN(*pulled, head->PullGradient(pull.dtype(), pull.reset()));
        *response.mutable_summary() = pulled->summary;
      }
      break;
    }
    case v1::ControlRequest::kPushWeights: {
      const v1::PushControl& push = request.push_weights();
      LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, registry.Get(push.header().head()));
      std::string data;
      if (request.origin() == rank()) {
        absl::MutexLock lock(&mu_);
        auto it = pushes_.find(push.push_id());
        if (it == pushes_.end()) {
          return absl::InternalError(
              absl::StrCat("push ", push.push_id(), " is not held by its origin"));
        }
        data = std::move(it->second);
        pushes_.erase(it);
      } else {
        data.assign(push.bytes(), '\0');
      }
      LOSSHEAD_RETURN_IF_ERROR(window_->Broadcast(data, request.origin()));
      const v1::PushHeader& h = push.header();
      LOSSHEAD_ASSIGN_OR_RETURN(
          const uint64_t version,
          head->PushWeights(h.dtype(), h.mode(), data,
                            h.has_expected_weights_version()
                                ? std::optional<uint64_t>(h.expected_weights_version())
                                : std::nullopt));
      response.set_weights_version(version);
      ctx_->metrics->Push(head->name());
      break;
    }
    case v1::ControlRequest::kCheckpoint: {
      if (sets_ == nullptr) {
        return absl::FailedPreconditionError(
            "checkpoints are disabled on this process (no --checkpoint_dir)");
      }
      LOSSHEAD_ASSIGN_OR_RETURN(auto written, sets_->WritePart(request.checkpoint().cut()));
      *response.mutable_part() = std::move(written.first);
      *response.mutable_checkpoint() = std::move(written.second);
      break;
    }
    case v1::ControlRequest::kCheckpointCommit:
      if (sets_ == nullptr) {
        return absl::FailedPreconditionError(
            "checkpoints are disabled on this process (no --checkpoint_dir)");
      }
      LOSSHEAD_RETURN_IF_ERROR(sets_->Commit(request.checkpoint_commit().cut()));
      break;
    case v1::ControlRequest::kStep: {
      const v1::StepControl& step = request.step();
      // Its turn is passed whatever happens here, so that the group's next micro-batches go on.
      StepTurn turn(turns_, step.turn());
      LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, registry.Get(step.header().head()));
      const bool origin = request.origin() == rank();
      PendingStep* pending = nullptr;
      MicroBatch received;
      if (origin) {
        absl::MutexLock lock(&mu_);
        auto it = steps_.find(step.step_id());
        if (it == steps_.end()) {
          return absl::InternalError(
              absl::StrCat("micro-batch ", step.step_id(), " is not held by its origin"));
        }
        pending = it->second;
      }
      // Its turn is fixed: whatever its caller sends from now on gets a later one.
      if (origin && pending->on_ordered != nullptr && *pending->on_ordered) {
        (*pending->on_ordered)();
      }
      if (!origin) LOSSHEAD_RETURN_IF_ERROR(UnpackTensors(step, &received));
      StepStats unused;
      absl::StatusOr<std::shared_ptr<const StepOutcome>> outcome =
          head->RunStep(origin ? *pending->microbatch : received, origin ? pending->stats : &unused,
                        request.origin(), turn);
      const absl::Status ran = outcome.status();
      if (origin) {
        absl::MutexLock lock(&mu_);
        pending->outcome = std::move(outcome);
        pending->ran = true;
      }
      LOSSHEAD_RETURN_IF_ERROR(ran);
      break;
    }
    case v1::ControlRequest::kSnapshot:
      return RunSnapshot(request);
    case v1::ControlRequest::kDownloadWeights: {
      // W gathered from every process's rows; the bytes stay with the origin (in `pulled`, its
      // summary carrying their dtype).
      const v1::DownloadWeightsRequest& download = request.download_weights();
      LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, registry.Get(download.head()));
      LOSSHEAD_ASSIGN_OR_RETURN(WeightsSnapshot snap, head->DownloadWeights(download.dtype()));
      response.set_weights_version(snap.version);
      *pulled = GradientSnapshot();
      pulled->summary.set_dtype(snap.dtype);
      pulled->data = std::move(snap.data);
      break;
    }
    case v1::ControlRequest::kEmbeddingRows: {
      // The rows every process owns sent to the origin, which keeps them (in `pulled`, its
      // summary carrying their dtype); a refusal is every process's alike, before any exchange.
      const v1::EmbeddingRowsRequest& rows = request.embedding_rows();
      LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, registry.Get(rows.head()));
      LOSSHEAD_ASSIGN_OR_RETURN(
          WeightsSnapshot snap,
          head->EmbeddingRows(rows.id_dtype(), rows.ids(), rows.dtype(),
                              rows.has_expected_weights_version()
                                  ? std::optional<uint64_t>(rows.expected_weights_version())
                                  : std::nullopt,
                              request.origin()));
      response.set_weights_version(snap.version);
      *pulled = GradientSnapshot();
      pulled->summary.set_dtype(snap.dtype);
      pulled->data = std::move(snap.data);
      break;
    }
    default:
      return absl::InvalidArgumentError("a control request without an operation");
  }
  return response;
}

absl::Status GroupControl::Agree(absl::string_view what, const absl::Status& mine) {
  LOSSHEAD_ASSIGN_OR_RETURN(std::vector<absl::Status> all, window_->GatherStatuses(what, mine));
  for (int p = 0; p < size(); ++p) {
    if (all[p].ok()) continue;
    if (p == rank()) return mine;
    return FromFollower(p, addresses_[p], all[p]);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Head>> GroupControl::CreateAcross(const v1::HeadSpec& spec) {
  HeadRegistry& registry = *ctx_->registry;
  // What each process can tell before its shards join the others' (a spec, a taken name, its
  // devices), agreed first: a refusal anywhere is every process's, and none enters the
  // collective's creation while another does not.
  absl::Status ready = Head::ValidateSpec(spec);
  if (ready.ok() && registry.Get(spec.name()).ok()) {
    ready = absl::AlreadyExistsError(absl::StrCat("head '", spec.name(), "' already exists"));
  }
  if (ready.ok() && spec.placement().kind() != v1::PLACEMENT_SHARDED) {
    ready = absl::InvalidArgumentError("placement.across_processes is for PLACEMENT_SHARDED only");
  }
  if (ready.ok()) ready = registry.Place(spec.placement()).status();
  LOSSHEAD_RETURN_IF_ERROR(Agree("the checks of a head sharded across processes", ready));
  absl::StatusOr<std::shared_ptr<Head>> head = registry.Create(spec);
  // Then its allocation (memory may fit one process and not another): kept only where it
  // succeeded everywhere.
  absl::Status created = Agree("the creation of a head sharded across processes", head.status());
  if (!created.ok()) {
    if (head.ok()) registry.Delete(spec.name()).IgnoreError();
    return created;
  }
  return head;
}

absl::StatusOr<std::shared_ptr<const StepOutcome>> GroupControl::Step(
    Head& head, const MicroBatch& mb, StepStats* stats, const std::string& authorization,
    const std::function<void()>& on_ordered) {
  float hidden_abs = 0;
  LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<const StepOutcome> replayed,
                            head.ClaimStep(mb, stats, &hidden_abs));
  if (replayed != nullptr) return replayed;
  v1::ControlRequest request;
  v1::StepControl& step = *request.mutable_step();
  *step.mutable_header() = mb.header;
  step.set_hidden_bytes(mb.hidden_bytes().size());
  step.set_targets_bytes(mb.targets.size());
  for (const std::string& input : mb.token_inputs) step.add_token_input_bytes(input.size());
  step.set_tensors(PackTensors(mb));
  step.set_hidden_max_abs(hidden_abs);
  PendingStep pending{.microbatch = &mb, .stats = stats, .on_ordered = &on_ordered};
  {
    absl::MutexLock lock(&mu_);
    step.set_step_id(++next_step_);
    steps_[step.step_id()] = &pending;
  }
  absl::StatusOr<v1::ControlResponse> done = Run(request, authorization);
  {
    absl::MutexLock lock(&mu_);
    steps_.erase(step.step_id());
  }
  if (pending.ran) return std::move(pending.outcome);
  // It never ran here: nothing counted here, and the claim is freed for a retry.
  head.AbandonStep(mb.header);
  if (!done.ok()) return done.status();
  return absl::InternalError("the leader answered a micro-batch that never ran at its origin");
}

}  // namespace losshead::server
