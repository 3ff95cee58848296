// Head's step pipeline: a micro-batch is prepared (step_prepare.h: validated, targets and hidden
// converted), takes its devices and an I/O slot of each (its placement's choice), is staged in on
// the slots' streams (step_staging.h), runs under its devices' compute locks (dW and the window's
// counters together; the run itself is the placement's), is staged out, and completes its
// idempotency claim (or fails it when the device fails once the run has begun, or abandons it when
// nothing was touched).
#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/kernels/step_bound.h"
#include "server/engine/head.h"
#include "server/engine/host_tensors.h"
#include "server/engine/proto_convert.h"
#include "server/engine/request_fingerprint.h"
#include "server/engine/step_devices.h"
#include "server/engine/step_staging.h"
#include "server/engine/transfer_buffers.h"

namespace losshead::server {

namespace {

// A micro-batch as errors name it.
std::string KeyOf(const std::string& client_id, uint64_t sequence) {
  if (client_id.empty()) return "(without a client id)";
  return absl::StrCat("(client '", client_id, "', sequence ", sequence, ")");
}

}  // namespace

StepTarget Head::StepTargetOf() const {
  return StepTarget{.vocab_size = vocab_size(),
                    .hidden_size = hidden_size(),
                    .dtype = dtype_,
                    .precision = group().precision(),
                    .backend = &group()[0].backend};
}

v1::LossOptions Head::Defaults() const {
  absl::MutexLock lock(&state_mu_);
  return defaults_;
}

absl::Status Head::CheckHeader(const v1::StepHeader& header) const {
  if (header.kind() == v1::STEP_KIND_EMBEDDING_GRAD) return CheckEmbeddingGradHeader(header);
  if (header.kind() != v1::STEP_KIND_LOSS) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown micro-batch kind ", static_cast<int>(header.kind())));
  }
  PreparedStep unused;
  return PrepareHeader(header, StepTargetOf(), Defaults(), &unused);
}

namespace {

// The targets' digest, extended by the token inputs' bytes when there are any: one value, so that
// a remembered fingerprint (and its checkpoint record) keeps its layout, and a micro-batch without
// inputs keeps the fingerprint it always had.
uint64_t WithTokenInputs(uint64_t targets, const std::array<std::string, kTokenInputs>& inputs) {
  bool any = false;
  for (const std::string& input : inputs) any = any || !input.empty();
  if (!any) return targets;
  ByteDigest digest;
  digest.Update(absl::string_view(reinterpret_cast<const char*>(&targets), sizeof(targets)));
  for (const std::string& input : inputs) {
    const uint64_t size = input.size();  // so that bytes cannot move from one input to the next
    digest.Update(absl::string_view(reinterpret_cast<const char*>(&size), sizeof(size)));
    digest.Update(input);
  }
  return digest.Value();
}

// What a replay of `mb` must match. The receiver digests the tensors while it assembles them;
// only a direct caller pays a pass over them here.
StepFingerprint FingerprintOf(const MicroBatch& mb) {
  return StepFingerprint{
      .hidden =
          mb.hidden_digest.has_value() ? *mb.hidden_digest : ByteDigest::Of(mb.hidden_bytes()),
      .targets = WithTokenInputs(
          mb.targets_digest.has_value() ? *mb.targets_digest : ByteDigest::Of(mb.targets),
          mb.token_inputs),
      .shape = StepShape(mb.header)};
}

}  // namespace

absl::StatusOr<std::shared_ptr<const StepOutcome>> Head::Step(
    const MicroBatch& mb, StepStats* stats, const std::function<void()>& on_ordered) {
  if (mb.header.kind() != v1::STEP_KIND_LOSS) {
    LOSSHEAD_RETURN_IF_ERROR(CheckHeader(mb.header));  // an unknown kind
    return StepEmbeddingGrad(mb, stats, on_ordered);
  }
  LOSSHEAD_ASSIGN_OR_RETURN(PreparedStep prepared, PrepareStep(mb, StepTargetOf(), Defaults()));
  prepared.hidden_root = placement_->HiddenRoot();
  // Forward-only counts nothing, so there is nothing a replay could protect from being counted
  // twice: it bypasses the cache both ways. Answering it from a counted micro-batch's result (or
  // remembering it so that a later counted one with the same key replays it) would hand a
  // training step's outcome to an evaluation, or skip a training step's dW.
  if (prepared.forward_only) return Compute(prepared, stats, "", 0, on_ordered);
  const std::string& client_id = mb.header.client_id();
  if (client_id.empty()) return Compute(prepared, stats, client_id, 0, on_ordered);

  const StepFingerprint fingerprint = FingerprintOf(mb);
  LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<const StepOutcome> remembered,
                            cache_.Begin(client_id, mb.header.sequence(), fingerprint));
  if (remembered != nullptr) {
    if (!remembered->failure.ok()) return remembered->failure;
    stats->replayed = true;
    return remembered;
  }
  // Compute settles the claim itself once the run has begun (Complete, or Fail after a device
  // failure: the micro-batch may be in dW). A failure before the run touched nothing and is
  // abandoned here so that a retry computes afresh; Abandon ignores a settled claim.
  auto outcome = Compute(prepared, stats, client_id, mb.header.sequence(), on_ordered);
  if (!outcome.ok()) cache_.Abandon(client_id, mb.header.sequence());
  return outcome;
}

absl::StatusOr<std::shared_ptr<const StepOutcome>> Head::ClaimStep(const MicroBatch& mb,
                                                                   StepStats* stats,
                                                                   float* hidden_abs) {
  const std::string& client_id = mb.header.client_id();
  if (mb.header.kind() != v1::STEP_KIND_LOSS) {
    LOSSHEAD_RETURN_IF_ERROR(CheckHeader(mb.header));  // an unknown kind
    // Validated whole here, as StepEmbeddingGrad does, so that every process's run passes.
    LOSSHEAD_ASSIGN_OR_RETURN(const PreparedEmbeddingGrad p,
                              PrepareEmbeddingGrad(mb, vocab_size(), hidden_size()));
    *hidden_abs = static_cast<float>(p.max_abs);
    if (client_id.empty()) return nullptr;
  } else {
    LOSSHEAD_ASSIGN_OR_RETURN(PreparedStep prepared, PrepareStep(mb, StepTargetOf(), Defaults()));
    *hidden_abs = static_cast<float>(prepared.hidden_abs);
    if (prepared.forward_only || client_id.empty()) return nullptr;
  }
  const StepFingerprint fingerprint = FingerprintOf(mb);
  LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<const StepOutcome> remembered,
                            cache_.Begin(client_id, mb.header.sequence(), fingerprint));
  if (remembered == nullptr) return nullptr;
  if (!remembered->failure.ok()) return remembered->failure;
  stats->replayed = true;
  return remembered;
}

absl::StatusOr<std::shared_ptr<const StepOutcome>> Head::RunStep(const MicroBatch& mb,
                                                                 StepStats* stats, int origin,
                                                                 StepTurn& turn) {
  if (mb.header.kind() != v1::STEP_KIND_LOSS) {
    absl::StatusOr<std::shared_ptr<const StepOutcome>> outcome =
        RunEmbeddingGrad(mb, stats, origin, turn);
    // A claim at the home that never reached dW is freed (a settled one stays).
    if (!outcome.ok() && origin == group().process()) AbandonStep(mb.header);
    return outcome;
  }
  // The same checks as at the home, on the same bytes and the same state: they pass here too.
  LOSSHEAD_ASSIGN_OR_RETURN(PreparedStep prepared, PrepareStep(mb, StepTargetOf(), Defaults()));
  // Its hidden states go from the origin's first shard to every other shard in the run: one copy
  // from the host, the rest over the collective (NVLink between GPUs), not over the group's TCP.
  prepared.hidden_root = group().FirstShardOf(origin);
  const bool here = origin == group().process();
  prepared.results_unread = !here;
  bool keyed = here && !prepared.forward_only && !mb.header.client_id().empty();
  const std::string client_id = keyed ? mb.header.client_id() : std::string();
  const uint64_t sequence = keyed ? mb.header.sequence() : 0;
  auto outcome = Compute(prepared, stats, client_id, sequence, nullptr, &turn);
  if (!outcome.ok() && keyed) cache_.Abandon(client_id, sequence);  // ignored once settled
  return outcome;
}

void Head::AbandonStep(const v1::StepHeader& header) {
  if (header.client_id().empty() || header.options().forward_only()) return;
  cache_.Abandon(header.client_id(), header.sequence());
}

absl::StatusOr<std::shared_ptr<const StepOutcome>> Head::Compute(
    const PreparedStep& p, StepStats* stats, const std::string& client_id, uint64_t sequence,
    const std::function<void()>& on_ordered, StepTurn* turn) {
  auto outcome = std::make_shared<StepOutcome>();
  const absl::Time slot_wait = absl::Now();
  // Its devices and a slot of each, device 0 returning the results (see Placement::Take).
  StepDevices devices;
  if (turn != nullptr) LOSSHEAD_RETURN_IF_ERROR(turn->AwaitTake());
  placement_->Take(p.problem.n, devices);
  if (turn != nullptr) turn->Taken();
  for (Replica* device : devices.replicas()) stats->devices.push_back(&device->backend);
  const absl::Time stage_start = absl::Now();
  stats->stage_start = stage_start;
  stats->queue += stage_start - slot_wait;
  // Copies in run outside the compute lock, beside the run of the micro-batch ahead of this one.
  for (size_t i = 0; i < devices.size(); ++i) {
    const int shard = group().first_shard() + devices.replica(i).rank;
    const bool hidden = !p.hidden_elsewhere && (p.hidden_root < 0 || shard == p.hidden_root);
    LOSSHEAD_RETURN_IF_ERROR(
        StageIn(p, devices.replica(i), devices.slot(i), /*outputs=*/i == 0, hidden, scratch_));
  }
  stats->stage += absl::Now() - stage_start;
  LOSSHEAD_ASSIGN_OR_RETURN(
      const RunScalars scalars,
      RunOnDevices(p, devices, stats, client_id, sequence, on_ordered, turn, *outcome));

  const absl::Time finish_start = absl::Now();
  std::string grad_hidden;  // compute dtype
  std::vector<float> per_token;
  std::string token_outputs;
  const bool keyed = !client_id.empty();  // forward-only comes without one: nothing remembered
  absl::Status out = p.results_unread ? absl::OkStatus()
                                      : StageOut(p, devices.replica(0), devices.slot(0), *results_,
                                                 &grad_hidden, &per_token, &token_outputs);
  if (out.ok()) {
    FinishOutcome(p, scalars, std::move(grad_hidden), per_token, token_outputs, outcome.get());
    if (keyed) cache_.Complete(client_id, sequence, outcome);
  } else if (!p.forward_only) {
    // Counted in dW and in the window, without a result: the key keeps this failure (before the
    // snapshot may run, as Complete would), so that no retry counts it a second time.
    out = absl::DataLossError(absl::StrCat(
        "micro-batch ", KeyOf(client_id, sequence), " was counted in dW (", scalars.token_count,
        " tokens) but the device failed while copying its loss and dH back: ", out.message(),
        keyed ? "; this key keeps this answer and is never counted again"
              : "; without a client id, sending it again counts it again"));
    if (keyed) cache_.Fail(client_id, sequence, out);
  }
  if (!p.forward_only) {
    absl::MutexLock state(&state_mu_);
    --pending_outcomes_;
  }
  stats->finish_end = absl::Now();
  stats->finish += stats->finish_end - finish_start;
  if (!out.ok()) return out;
  return outcome;
}

absl::StatusOr<Head::RunScalars> Head::RunOnDevices(const PreparedStep& p, StepDevices& devices,
                                                    StepStats* stats, const std::string& client_id,
                                                    uint64_t sequence,
                                                    const std::function<void()>& on_ordered,
                                                    StepTurn* group_turn, StepOutcome& outcome) {
  const absl::Time wait_start = absl::Now();
  Replica& first = devices.replica(0);
  if (group_turn != nullptr) LOSSHEAD_RETURN_IF_ERROR(group_turn->AwaitRun());
  std::optional<ComputeQueue::Turn> turn(first.compute_queue.Wait(p.problem.n));
  // Its devices' compute locks in rank order: one replica's, or every shard's (then the cut).
  std::optional<ReplicaGroup::DeviceLocks> locks(devices.replicas());
  if (on_ordered) on_ordered();
  const absl::Time start = absl::Now();
  stats->compute_start = start;
  stats->queue += start - wait_start;
  LOSSHEAD_ASSIGN_OR_RETURN(const uint64_t version, ReserveRun(p, devices.replicas()));
  const StepRun run{.problem = p.problem,
                    .grad_weight = !p.forward_only,
                    .grad_hidden = p.want_grad_hidden,
                    .per_token = p.want_per_token,
                    .outputs = p.outputs,
                    .inputs = p.inputs.inputs,
                    .workspace_budget = options_.workspace_budget_bytes,
                    .hidden_root = p.hidden_root};
  LOSSHEAD_RETURN_IF_ERROR(placement_->Prepare(run, devices, scratch_));
  absl::Status ran = placement_->Run(run, devices);
  // dH into the caller's device memory too (a same-node region), as the run's last work.
  std::optional<absl::Status> delivery;
  if (ran.ok() && DeliversGradHidden(p)) {
    delivery = QueueGradHiddenDelivery(p, first, devices.slot(0));
  }
  // The backends refused the run's arguments before launching anything (an output a backend or
  // a sharded head does not compute): nothing is in dW or counted, and the key is free again.
  const bool refused = absl::IsUnimplemented(ran);
  // Once launched the run is in flight: the locks and the turn go to the next micro-batch, whose
  // run the devices take up behind this one's without a gap, while this one waits for its own
  // work, then counts itself or keeps its failure (a Cut waits for either). A run that failed to
  // launch keeps the locks until its failure is kept. Its rows of a deferred-dW stash are taken
  // at launch, since the next run's go after them: should its work then fail, they stay, as a
  // failed run's part of dW does (DATA_LOSS below).
  if (ran.ok()) ran = devices.Launched();
  const bool in_flight = ran.ok();
  devices.EndRun(p.problem.n, in_flight);
  // Its exchanges are issued: the group's next run may begin.
  if (group_turn != nullptr) group_turn->Ran();
  if (in_flight) {
    locks.reset();
    turn.reset();
    ran = devices.AwaitLaunched();
  }
  // The scalars come back through the slot's own stream, which no other run's work is behind.
  char scalars[kStepScalarBytes];
  if (ran.ok()) {
    const IoSlot& out = devices.slot(0);
    ran = first.backend.CopyToHost(scalars, out.scalars.data(), kStepScalarBytes, *out.copies);
    if (ran.ok()) ran = out.copies->Synchronize();
  }
  // Counted (or failed) before it lands: a Cut then finds it in the window.
  absl::Cleanup landed = [&devices] { devices.Landed(); };
  if (!ran.ok()) {
    // Forward-only: dW was not an argument, nothing can be in it.
    if (p.forward_only || refused) return ran;
    if (group().across_processes() && absl::IsUnavailable(ran)) {
      // An exchange with the other processes failed: the group is broken, and no process can
      // count this micro-batch or cut the window again. The key keeps this answer.
      absl::Status broken = absl::UnavailableError(absl::StrCat(
          "micro-batch ", KeyOf(client_id, sequence),
          " could not run on every process of the head's group: ", ran.message(),
          "; the group is broken and must be rebuilt",
          client_id.empty() ? "" : "; this key keeps this answer and is never computed again"));
      if (!client_id.empty()) cache_.Fail(client_id, sequence, broken);
      return broken;
    }
    // The run may have added some of its chunks to dW before it failed, and there is no exact
    // way to take them out again. The key keeps this answer: a retry must not add them twice.
    const bool keyed = !client_id.empty();
    absl::Status fault = absl::DataLossError(absl::StrCat(
        "the device failed while running micro-batch ", KeyOf(client_id, sequence), ": ",
        ran.message(),
        "; dW may hold part of it, which the gradient window's counters do not count: pull "
        "with reset to drop the window before the next optimizer step",
        keyed ? "; this key keeps this answer and is never computed again" : ""));
    if (keyed) cache_.Fail(client_id, sequence, fault);
    return fault;
  }
  stats->grad_hidden_delivery = delivery;  // landed with the run
  RunScalars result;
  std::memcpy(&result.token_count, scalars + kTokenCountOffset, 8);
  std::memcpy(&result.loss_sum, scalars + kLossSumOffset, 4);
  if (p.outputs.correct_count) {
    std::memcpy(&result.correct_count, scalars + kCorrectCountOffset, 8);
  }
  if (!p.forward_only) CountRun(result.token_count, version);
  outcome.weights_version = version;
  outcome.forward_only = p.forward_only;
  stats->compute_end = absl::Now();
  stats->compute += stats->compute_end - start;
  devices.ReleaseQueued();
  return result;
}

absl::StatusOr<uint64_t> Head::ReserveRun(const PreparedStep& p,
                                          std::span<Replica* const> devices) {
  uint64_t version;
  absl::Status bounded;
  bool bound_exact;
  {
    // W and the window stay as they are read here until the run is over: a push, an apply or a
    // pull takes this micro-batch's compute locks too.
    absl::MutexLock state(&state_mu_);
    version = version_;
    if (p.expected_version.has_value() && *p.expected_version != version) {
      return absl::FailedPreconditionError(
          absl::StrCat("expected_weights_version is ", *p.expected_version,
                       " but the head's weights are at version ", version));
    }
    bounded = ReserveStepBounds(p);
    bound_exact = weight_abs_exact_;
  }
  if (absl::IsOutOfRange(bounded) && !bound_exact) {
    // Refused on the optimizer's bound of W: W itself decides.
    LOSSHEAD_ASSIGN_OR_RETURN(float measured, MeasureWeights(devices));
    if (across_processes()) {
      // This process holds only its rows: the largest over every process's, so that every
      // process decides alike (each reaches this point for the same micro-batch, the bounds it
      // checks being the same everywhere).
      LOSSHEAD_ASSIGN_OR_RETURN(const std::vector<double> every,
                                GatherDoubles("the largest |w| of W", {double{measured}}));
      for (double m : every) measured = std::max(measured, static_cast<float>(m));
    }
    absl::MutexLock state(&state_mu_);
    weight_abs_ = measured;
    weight_abs_exact_ = true;
    bounded = ReserveStepBounds(p);
  }
  LOSSHEAD_RETURN_IF_ERROR(bounded);
  return version;
}

void Head::CountRun(int64_t token_count, uint64_t version) {
  absl::MutexLock state(&state_mu_);
  window_.Count(token_count, version);
  WarnOfUnappliedWindowLocked();
  // Counted in dW, not yet remembered: a snapshot waits for this outcome (see Snapshot).
  ++pending_outcomes_;
}

absl::Status Head::ReserveStepBounds(const PreparedStep& p) {
  const kernels::StepBounds bounds =
      kernels::BoundStep(p.problem, p.hidden_abs, weight_abs_, p.counted_tokens, p.input_bounds);
  LOSSHEAD_RETURN_IF_ERROR(kernels::CheckStepBounds(p.problem, bounds, p.hidden_abs, weight_abs_,
                                                    p.grad_hidden_dtype, !p.forward_only));
  if (p.forward_only) return absl::OkStatus();
  return window_.ReserveBound(bounds.grad_weight);
}

absl::StatusOr<float> Head::MeasureWeights(std::span<Replica* const> held) {
  const size_t esize = kernels::DTypeSize(dtype_);
  float largest = 0;
  for (Replica* r : held) {
    const size_t count = static_cast<size_t>(ReplicaGroup::DeviceRows(*r)) * hidden_size();
    std::string host = TakeTransferBuffer(count * esize);  // overwritten whole by the copy
    absl::Cleanup recycle = [&host] { GiveTransferBuffer(std::move(host)); };
    LOSSHEAD_RETURN_IF_ERROR(
        r->backend.CopyToHost(host.data(), r->weights.data(), count * esize, *r->stream));
    LOSSHEAD_RETURN_IF_ERROR(r->stream->Synchronize());
    largest = std::max(largest, kernels::MaxAbs(dtype_, host.data(), count));
  }
  return largest;
}

void Head::FinishOutcome(const PreparedStep& p, const RunScalars& scalars, std::string grad_hidden,
                         const std::vector<float>& per_token, const std::string& token_outputs,
                         StepOutcome* outcome) const {
  const float loss_sum = scalars.loss_sum;
  const int64_t token_count = scalars.token_count;
  outcome->loss_sum = loss_sum;
  outcome->token_count = token_count;
  const kernels::LossOptions& options = p.problem.options;
  outcome->policy_gradient = options.kind == kernels::LossKind::kPolicyGradient;
  outcome->entropy_term = options.entropy_coef != 0.0f;
  outcome->kl_term = options.kl_coef > 0.0f;
  outcome->loss = p.problem.options.reduction == kernels::Reduction::kMean
                      ? (token_count > 0 ? static_cast<double>(loss_sum) / token_count : 0.0)
                      : static_cast<double>(loss_sum);
  outcome->grad_hidden_dtype = ToProto(p.grad_hidden_dtype);
  if (p.results_unread) return;  // nothing was copied back
  if (p.want_grad_hidden) {
    if (p.grad_hidden_dtype == dtype_) {
      outcome->grad_hidden = std::move(grad_hidden);
    } else {
      outcome->grad_hidden = ConvertOnHost(dtype_, grad_hidden, p.grad_hidden_dtype);
      results_->Give(std::move(grad_hidden));
    }
    outcome->pool = results_;
  }
  if (p.want_per_token) {
    outcome->per_token_loss.assign(reinterpret_cast<const char*>(per_token.data()),
                                   per_token.size() * sizeof(float));
  }
  const size_t each = p.problem.n * kTokenOutputBytes;
  for (int i = 0; i < kTokenOutputs; ++i) {
    const auto output = static_cast<TokenOutput>(i);
    if (!p.outputs.asks(output)) continue;
    outcome->token_outputs[i] = token_outputs.substr(p.outputs.slot(output) * each, each);
  }
  if (p.outputs.top_k > 0) {
    const size_t top_k_bytes = each * p.outputs.top_k;
    outcome->top_k_ids = token_outputs.substr(p.outputs.top_k_ids_offset(p.problem.n), top_k_bytes);
    outcome->top_k_logprobs =
        token_outputs.substr(p.outputs.top_k_logprobs_offset(p.problem.n), top_k_bytes);
  }
  if (p.outputs.correct_count) outcome->correct_count = scalars.correct_count;
}

}  // namespace losshead::server
