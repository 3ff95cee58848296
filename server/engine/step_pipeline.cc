// Head's step pipeline: a micro-batch is prepared (validated, targets and hidden converted), takes
// an I/O slot, is staged in on the slot's stream, runs under the compute lock (dW and the window's
// counters together), is staged out, and completes its idempotency claim (or fails it when the
// device fails once the run has begun, or abandons it when nothing was touched).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/kernels/step_bound.h"
#include "losshead/v1/wire_dtype.h"
#include "server/engine/head.h"
#include "server/engine/head_internal.h"
#include "server/engine/head_registry.h"
#include "server/engine/proto_convert.h"
#include "server/engine/replica_group.h"
#include "server/engine/request_fingerprint.h"
#include "common/status_macros.h"
#include "server/engine/transfer_buffers.h"

namespace losshead::server {

using head_internal::AsResourceExhausted;
using head_internal::Convert;

namespace {

void ReportReleasedStash(const std::string& head, size_t bytes) {
  std::fprintf(stderr,
               "losshead-server: head '%s' gave its deferred-dW stash (%zu bytes) back for memory "
               "that something else needed; its micro-batches add to dW directly until a deleted "
               "head frees memory there (a smaller --grad_stash_bytes keeps a stash)\n",
               head.c_str(), bytes);
}

// Under the replica's compute lock, after a run of `tokens` on it: rows it stashed count once the
// run is through (a failed run's are left out of dW), and the idle flush's clock starts again.
void EndRun(Replica& replica, const kernels::GradStash& stash, int64_t tokens, bool ran)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(replica.compute_mu) {
  if (ran && stash.data != nullptr) {
    replica.stash_tokens += tokens;
    replica.stashed_tokens = replica.stash_tokens;
  }
  replica.last_run_end_ns = absl::GetCurrentTimeNanos();
}

// The most tokens a gradient stash of at most `budget` bytes holds on `backend` (0: none, or the
// backend has no stash). Its bytes grow with its capacity, alignment padding included, so a
// bisection finds the exact largest.
int64_t StashCapacity(const kernels::Backend& backend, const kernels::Problem& problem,
                      size_t budget) {
  auto fits = [&](int64_t capacity) {
    absl::StatusOr<size_t> bytes = backend.GradStashBytes(problem, capacity);
    return bytes.ok() && *bytes <= budget;
  };
  if (!fits(1)) return 0;
  // A token stashes its v gradients and d hidden values, at least a byte each.
  int64_t lo = 1;
  int64_t hi = static_cast<int64_t>(budget / static_cast<size_t>(problem.v + problem.d));
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// A micro-batch as errors name it.
std::string KeyOf(const std::string& client_id, uint64_t sequence) {
  if (client_id.empty()) return "(without a client id)";
  return absl::StrCat("(client '", client_id, "', sequence ", sequence, ")");
}

}  // namespace

struct Head::Prepared {
  kernels::Problem problem;
  // N x D in the head's dtype: the request's own bytes when they arrived in it, else `converted`.
  std::optional<absl::string_view> request_hidden;
  // The request's bytes are page-locked (MicroBatch::pinned_hidden): copied to the device as
  // they are.
  bool request_pinned = false;
  std::string converted;
  absl::string_view hidden() const { return request_hidden ? *request_hidden : converted; }
  std::vector<int32_t> targets;
  bool want_grad_hidden = true;
  kernels::DType grad_hidden_dtype = kernels::DType::kFP32;
  bool want_per_token = false;
  std::optional<uint64_t> expected_version;
  bool forward_only = false;  // no dW, no counters, no idempotency (evaluation)
  kernels::DType hidden_dtype = kernels::DType::kFP32;  // as sent
  double hidden_abs = 0;       // the largest |h| in the head's dtype (finite)
  int64_t counted_tokens = 0;  // targets that are not ignore_index
  int64_t ignore_index = 0;  // as resolved; problem.options has its int32 image
};

// Takes a free I/O slot of a replica (waiting for one) and gives it back on destruction.
class Head::SlotLease {
 public:
  explicit SlotLease(Replica& replica) : replica_(replica) {
    absl::MutexLock lock(&replica_.slots_mu);
    replica_.slots_mu.Await(absl::Condition(
        +[](std::vector<std::unique_ptr<IoSlot>>* free) { return !free->empty(); },
        &replica_.free_slots));
    slot_ = std::move(replica_.free_slots.back());
    replica_.free_slots.pop_back();
  }
  ~SlotLease() {
    absl::MutexLock lock(&replica_.slots_mu);
    replica_.free_slots.push_back(std::move(slot_));
  }
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;
  IoSlot& operator*() const { return *slot_; }

 private:
  Replica& replica_;
  std::unique_ptr<IoSlot> slot_;
};

absl::Status Head::CheckHeader(const v1::StepHeader& header) const {
  Prepared unused;
  return PrepareHeader(header, &unused);
}

absl::Status Head::PrepareHeader(const v1::StepHeader& h, Prepared* prepared) const {
  Prepared& p = *prepared;
  if (h.num_tokens() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens must be >= 1, got ", h.num_tokens()));
  }
  LOSSHEAD_ASSIGN_OR_RETURN(p.hidden_dtype, FloatDType(h.hidden_dtype(), "hidden_dtype"));
  if (h.target_dtype() != v1::DTYPE_INT32 && h.target_dtype() != v1::DTYPE_INT64) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_dtype must be DTYPE_INT32 or DTYPE_INT64, got ",
                     static_cast<int>(h.target_dtype())));
  }
  p.want_grad_hidden = !h.options().skip_grad_hidden();
  if (h.options().grad_hidden_dtype() == v1::DTYPE_UNSPECIFIED) {
    p.grad_hidden_dtype = p.hidden_dtype;
  } else {
    LOSSHEAD_ASSIGN_OR_RETURN(p.grad_hidden_dtype, FloatDType(h.options().grad_hidden_dtype(),
                                                              "options.grad_hidden_dtype"));
  }
  v1::LossOptions defaults;
  {
    absl::MutexLock lock(&state_mu_);
    defaults = defaults_;
  }
  LOSSHEAD_ASSIGN_OR_RETURN(kernels::LossOptions loss,
                            ResolveLossOptions(h.loss_options(), defaults, &h.options()));
  p.want_per_token =
      h.options().return_per_token_loss() || loss.reduction == kernels::Reduction::kNone;
  // Targets are int32 for the kernels. An ignore_index beyond int32 is mapped to INT32_MIN, which
  // no valid target can equal.
  p.ignore_index = loss.ignore_index;
  const bool ignore_fits = p.ignore_index >= std::numeric_limits<int32_t>::min() &&
                           p.ignore_index <= std::numeric_limits<int32_t>::max();
  loss.ignore_index =
      ignore_fits ? static_cast<int32_t>(p.ignore_index) : std::numeric_limits<int32_t>::min();
  p.problem = kernels::Problem{.n = h.num_tokens(),
                               .d = hidden_size(),
                               .v = vocab_size(),
                               .dtype = dtype_,
                               .options = loss,
                               .precision = group_->precision()};
  // Every replica's backend is of one kind and answers the same.
  LOSSHEAD_RETURN_IF_ERROR((*group_)[0].backend.CanImplement(p.problem));
  if (h.options().has_expected_weights_version()) {
    p.expected_version = h.options().expected_weights_version();
  }
  p.forward_only = h.options().forward_only();
  return absl::OkStatus();
}

absl::StatusOr<Head::Prepared> Head::Prepare(const MicroBatch& mb) const {
  const v1::StepHeader& h = mb.header;
  Prepared p;
  LOSSHEAD_RETURN_IF_ERROR(PrepareHeader(h, &p));
  const uint64_t n = h.num_tokens();
  const uint64_t d = hidden_size();
  const size_t hsize = kernels::DTypeSize(p.hidden_dtype);
  const size_t tsize = v1::WireDTypeSize(h.target_dtype());
  const absl::string_view hidden = mb.hidden_bytes();
  // Compare sizes without overflowing n * d * size for absurd n.
  if (n > hidden.size() / (d * hsize) || n * d * hsize != hidden.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden has ", hidden.size(), " bytes; num_tokens x hidden_size x ",
                     kernels::DTypeName(p.hidden_dtype), " needs ", n, " x ", d, " x ", hsize));
  }
  if (n * tsize != mb.targets.size()) {
    return absl::InvalidArgumentError(absl::StrCat("targets has ", mb.targets.size(),
                                                   " bytes; num_tokens needs ", n, " x ", tsize));
  }
  const int64_t ignore = p.ignore_index;
  const int32_t ignore32 = p.problem.options.ignore_index;
  p.targets.resize(n);
  const int64_t v = vocab_size();
  for (uint64_t i = 0; i < n; ++i) {
    int64_t t;
    if (h.target_dtype() == v1::DTYPE_INT32) {
      int32_t t32;
      std::memcpy(&t32, mb.targets.data() + i * 4, 4);
      t = t32;
    } else {
      std::memcpy(&t, mb.targets.data() + i * 8, 8);
    }
    if (t == ignore) {
      p.targets[i] = ignore32;
      continue;
    }
    if (t < 0 || t >= v) {
      return absl::InvalidArgumentError(absl::StrCat("targets[", i, "] = ", t, " is outside [0, ",
                                                     v, ") and is not ignore_index ", ignore));
    }
    p.targets[i] = static_cast<int32_t>(t);
    ++p.counted_tokens;
  }

  // NaN policy: non-finite hidden states are rejected, never computed: they would poison dW for
  // every micro-batch accumulated with them until the next pull. The receiver checks as the
  // pieces arrive, while they are in cache; a direct caller's micro-batch is checked here.
  // Its magnitude, taken in the same pass, bounds what the run computes (ReserveStepBounds).
  const float max_abs = mb.hidden_max_abs.has_value()
                            ? *mb.hidden_max_abs
                            : kernels::MaxAbs(p.hidden_dtype, hidden.data(), n * d);
  if (!std::isfinite(max_abs)) return absl::InvalidArgumentError("hidden contains NaN or Inf");
  p.hidden_abs = max_abs;
  if (p.hidden_dtype == dtype_) {
    p.request_hidden = hidden;
    p.request_pinned = mb.pinned_hidden != nullptr;
  } else {
    p.converted = Convert(p.hidden_dtype, hidden, dtype_);
    const float converted_abs = kernels::MaxAbs(dtype_, p.converted.data(), n * d);
    if (!std::isfinite(converted_abs)) {
      return absl::InvalidArgumentError(
          absl::StrCat("hidden overflows the head's dtype ", kernels::DTypeName(dtype_)));
    }
    p.hidden_abs = converted_abs;
  }
  return p;
}

absl::StatusOr<std::shared_ptr<const StepOutcome>> Head::Step(
    const MicroBatch& mb, StepStats* stats, const std::function<void()>& on_ordered) {
  LOSSHEAD_ASSIGN_OR_RETURN(Prepared prepared, Prepare(mb));
  // Forward-only counts nothing, so there is nothing a replay could protect from being counted
  // twice: it bypasses the cache both ways. Answering it from a counted micro-batch's result (or
  // remembering it so that a later counted one with the same key replays it) would hand a
  // training step's outcome to an evaluation, or skip a training step's dW.
  if (prepared.forward_only) return Compute(prepared, stats, "", 0, on_ordered);
  const std::string& client_id = mb.header.client_id();
  if (client_id.empty()) return Compute(prepared, stats, client_id, 0, on_ordered);

  // The receiver digests the tensors while it assembles them; only a direct caller pays a pass.
  const StepFingerprint fingerprint{
      .hidden =
          mb.hidden_digest.has_value() ? *mb.hidden_digest : ByteDigest::Of(mb.hidden_bytes()),
      .targets = mb.targets_digest.has_value() ? *mb.targets_digest : ByteDigest::Of(mb.targets),
      .shape = StepShape(mb.header)};
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

absl::Status Head::EnsureBuffer(Replica& replica, kernels::DeviceBuffer& buffer, size_t bytes,
                                bool compute_locked) {
  if (buffer.bytes() >= bytes) return absl::OkStatus();
  const size_t old = buffer.bytes();
  buffer.Reset();  // free first: the old and new buffer need not fit together
  auto fresh = replica.backend.Allocate(bytes);
  if (absl::IsResourceExhausted(fresh.status())) {
    std::optional<absl::MutexLock> lock;
    if (!compute_locked) lock.emplace(&replica.compute_mu);
    const size_t stashed = replica.stash.bytes();
    const kernels::MemoryInfo memory = replica.backend.memory_info();
    // Only where that makes room: a buffer that would not fit even so leaves the stash be.
    if (stashed > 0 && (memory.total_bytes == 0 || bytes <= memory.free_bytes + stashed)) {
      ReportReleasedStash(name(), group_->ReleaseStash(replica));
      fresh = replica.backend.Allocate(bytes);
    }
  }
  // Then the other heads' stashes on the device, those that are idle.
  if (absl::IsResourceExhausted(fresh.status()) && options_.stash_lenders != nullptr &&
      options_.stash_lenders->TakeBack(replica.backend, this, bytes) > 0) {
    fresh = replica.backend.Allocate(bytes);
  }
  if (!fresh.ok()) {
    replica.scratch_bytes -= old;
    return AsResourceExhausted(fresh.status(), "micro-batch buffers");
  }
  buffer = std::move(*fresh);
  replica.scratch_bytes += bytes - old;
  return absl::OkStatus();
}

absl::StatusOr<kernels::GradStash> Head::StashFor(Replica& replica,
                                                  const kernels::Problem& problem) {
  // Memory was freed on this device since the stash gave way or did not fit: try again.
  if (replica.stash_capacity == -1 && replica.stash_retry.exchange(false) &&
      std::exchange(replica.stash_wanted, false)) {
    replica.stash_capacity = 0;
  }
  if (replica.stash_capacity == 0) {
    // First use on this device: the most tokens the budget holds, or none.
    replica.stash_capacity = -1;
    kernels::Backend& backend = replica.backend;
    const int64_t capacity = StashCapacity(backend, problem, options_.grad_stash_bytes);
    if (capacity > 0) {
      const size_t bytes = *backend.GradStashBytes(problem, capacity);
      // A device short of memory runs without a stash, as before one existed.
      absl::StatusOr<kernels::DeviceBuffer> stash = backend.Allocate(bytes);
      if (stash.ok()) {
        replica.stash = std::move(*stash);
        replica.stash_capacity = capacity;
        replica.stash_held = bytes;
        replica.scratch_bytes += bytes;
      } else {
        replica.stash_wanted = true;
      }
    }
  }
  if (problem.n > replica.stash_capacity) return kernels::GradStash{};
  if (replica.StashFullFor(problem.n)) LOSSHEAD_RETURN_IF_ERROR(group_->FlushStash(replica));
  return kernels::GradStash{.data = replica.stash.data(),
                            .capacity = replica.stash_capacity,
                            .tokens = replica.stash_tokens};
}

void Head::ForEachReplicaOn(const kernels::Backend* device,
                            absl::FunctionRef<void(Replica&)> fn) const {
  for (const auto& r : group_->replicas()) {
    if (&r->backend != device) continue;
    absl::MutexLock lock(&r->compute_mu);
    fn(*r);
  }
}

void Head::RetryStashes(const kernels::Backend* device) {
  for (const auto& r : group_->replicas()) {
    if (&r->backend == device) r->stash_retry = true;  // taken by the next micro-batch (StashFor)
  }
}

size_t Head::StashBytes(const kernels::Backend* device) const {
  size_t bytes = 0;
  for (const auto& r : group_->replicas()) {
    if (&r->backend == device) bytes += r->stash_held.load();
  }
  return bytes;
}

size_t Head::TryReleaseStashes(const kernels::Backend* device) {
  size_t released = 0;
  for (const auto& r : group_->replicas()) {
    // A replica at work keeps its stash: the caller holds compute locks of its own, so waiting
    // here for this one could deadlock.
    if (&r->backend != device || !r->compute_mu.TryLock()) continue;
    released += group_->ReleaseStash(*r);
    r->compute_mu.Unlock();
  }
  if (released > 0) ReportReleasedStash(name(), released);
  return released;
}

size_t Head::ReleaseStashes(const kernels::Backend* device) {
  size_t released = 0;
  ForEachReplicaOn(device, [&](Replica& r) { released += group_->ReleaseStash(r); });
  if (released > 0) ReportReleasedStash(name(), released);
  return released;
}

absl::StatusOr<bool> Head::EnsureStaging(Replica& replica, kernels::HostBuffer& buffer,
                                         size_t bytes) {
  if (buffer.bytes() >= bytes) return true;
  buffer.Reset();
  absl::StatusOr<kernels::HostBuffer> fresh = replica.backend.AllocateHost(bytes);
  if (absl::IsUnimplemented(fresh.status())) return false;
  if (!fresh.ok()) return AsResourceExhausted(fresh.status(), "micro-batch staging memory");
  buffer = std::move(*fresh);
  return true;
}

absl::Status Head::StageIn(const Prepared& p, Replica& replica, IoSlot& slot, bool outputs) {
  kernels::Backend& backend = replica.backend;
  const size_t n = p.problem.n;
  const size_t hidden_bytes = n * hidden_size() * kernels::DTypeSize(dtype_);
  const size_t targets_bytes = n * sizeof(int32_t);
  if (slot.copies == nullptr) {
    LOSSHEAD_ASSIGN_OR_RETURN(slot.copies, backend.CreateStream());
  }
  LOSSHEAD_RETURN_IF_ERROR(EnsureBuffer(replica, slot.hidden, hidden_bytes, false));
  LOSSHEAD_RETURN_IF_ERROR(EnsureBuffer(replica, slot.targets, targets_bytes, false));
  LOSSHEAD_RETURN_IF_ERROR(EnsureBuffer(replica, slot.scalars, 16, false));
  const bool grad_hidden = outputs && p.want_grad_hidden;
  const bool per_token = outputs && p.want_per_token;
  if (grad_hidden) {
    LOSSHEAD_RETURN_IF_ERROR(EnsureBuffer(replica, slot.grad_hidden, hidden_bytes, false));
  }
  if (per_token) {
    LOSSHEAD_RETURN_IF_ERROR(EnsureBuffer(replica, slot.per_token, n * sizeof(float), false));
  }
  // The larger of the two directions: the buffer serves the copies in, then the copies out.
  const size_t out_bytes = (grad_hidden ? hidden_bytes : 0) + (per_token ? n * sizeof(float) : 0);
  LOSSHEAD_ASSIGN_OR_RETURN(
      const bool staged,
      EnsureStaging(replica, slot.staging, std::max(hidden_bytes + targets_bytes, out_bytes)));
  const char* hidden = p.hidden().data();
  const char* targets = reinterpret_cast<const char*>(p.targets.data());
  if (staged) {
    // Page-locked memory copies at the bus rate and asynchronously; a copy from the request's own
    // (pageable) bytes would go through the driver's bounce buffer at a fraction of it. Hidden
    // states the receiver assembled in page-locked memory need no staging.
    if (!p.request_pinned) {
      std::memcpy(slot.staging.data(), hidden, hidden_bytes);
      hidden = slot.staging.data();
    }
    std::memcpy(slot.staging.data() + hidden_bytes, targets, targets_bytes);
    targets = slot.staging.data() + hidden_bytes;
  }
  LOSSHEAD_RETURN_IF_ERROR(
      backend.CopyToDevice(slot.hidden.data(), hidden, hidden_bytes, *slot.copies));
  LOSSHEAD_RETURN_IF_ERROR(
      backend.CopyToDevice(slot.targets.data(), targets, targets_bytes, *slot.copies));
  return slot.copies->Synchronize();
}

absl::Status Head::StageOut(const Prepared& p, Replica& replica, IoSlot& slot,
                            std::string* grad_hidden, std::vector<float>* per_token) {
  kernels::Backend& backend = replica.backend;
  const size_t n = p.problem.n;
  const size_t hidden_bytes = n * hidden_size() * kernels::DTypeSize(dtype_);
  const bool staged = slot.staging.bytes() > 0;
  // Every byte is overwritten below: a recycled buffer needs neither zeroing nor page faults.
  if (p.want_grad_hidden) *grad_hidden = results_->Take(hidden_bytes);
  if (p.want_per_token) per_token->resize(n);
  char* dh = staged ? slot.staging.data() : grad_hidden->data();
  char* pt = staged ? slot.staging.data() + (p.want_grad_hidden ? hidden_bytes : 0)
                    : reinterpret_cast<char*>(per_token->data());
  if (p.want_grad_hidden) {
    LOSSHEAD_RETURN_IF_ERROR(
        backend.CopyToHost(dh, slot.grad_hidden.data(), hidden_bytes, *slot.copies));
  }
  if (p.want_per_token) {
    LOSSHEAD_RETURN_IF_ERROR(
        backend.CopyToHost(pt, slot.per_token.data(), n * sizeof(float), *slot.copies));
  }
  LOSSHEAD_RETURN_IF_ERROR(slot.copies->Synchronize());
  if (staged) {
    if (p.want_grad_hidden) std::memcpy(grad_hidden->data(), dh, hidden_bytes);
    if (p.want_per_token) std::memcpy(per_token->data(), pt, n * sizeof(float));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const StepOutcome>> Head::Compute(
    const Prepared& p, StepStats* stats, const std::string& client_id, uint64_t sequence,
    const std::function<void()>& on_ordered) {
  auto outcome = std::make_shared<StepOutcome>();
  const size_t n = p.problem.n;
  std::string grad_hidden;  // compute dtype
  std::vector<float> per_token;
  float loss_sum = 0;
  int64_t token_count = 0;
  // Forward-only micro-batches come without a client id (Step): nothing of theirs is remembered.
  const bool keyed = !client_id.empty();

  const absl::Time slot_wait = absl::Now();
  const int64_t tokens = static_cast<int64_t>(n);
  // The devices it runs on: one replica, or every shard of a sharded head, shard 0 returning the
  // results; its tokens count as queued on each until its run is over (or it fails before), which
  // keeps their stashes' idle flush away. Slots are taken in rank order, so that two micro-batches
  // waiting for them never deadlock.
  std::vector<std::unique_ptr<ReplicaGroup::Assignment>> assignments;
  if (group_->sharded()) {
    for (const auto& r : group_->replicas()) {
      assignments.push_back(std::make_unique<ReplicaGroup::Assignment>(*r, tokens));
    }
  } else {
    assignments.push_back(std::make_unique<ReplicaGroup::Assignment>(group_->Next(), tokens));
  }
  std::vector<Replica*> devices;
  for (const auto& a : assignments) devices.push_back(&a->replica());
  Replica& replica = *devices[0];
  for (const Replica* device : devices) stats->devices.push_back(&device->backend);
  std::vector<std::unique_ptr<SlotLease>> leases;
  std::vector<IoSlot*> slots;
  for (Replica* device : devices) {
    leases.push_back(std::make_unique<SlotLease>(*device));
    slots.push_back(&**leases.back());
  }
  IoSlot& slot = *slots[0];
  const absl::Time stage_start = absl::Now();
  stats->stage_start = stage_start;
  stats->queue += stage_start - slot_wait;
  // Copies in run outside the compute lock, beside the run of the micro-batch ahead of this one.
  for (size_t i = 0; i < devices.size(); ++i) {
    LOSSHEAD_RETURN_IF_ERROR(StageIn(p, *devices[i], *slots[i], /*outputs=*/i == 0));
  }
  stats->stage += absl::Now() - stage_start;
  {
    const absl::Time wait_start = absl::Now();
    const ComputeQueue::Turn turn = replica.compute_queue.Wait(tokens);
    // Its replica's lock, or every shard's (the cut: in rank order, as every cut takes them).
    std::optional<absl::MutexLock> lock;
    std::optional<ReplicaGroup::Cut> cut;
    if (group_->sharded()) {
      cut.emplace(*group_);
    } else {
      lock.emplace(&replica.compute_mu);
    }
    if (on_ordered) on_ordered();
    const absl::Time start = absl::Now();
    stats->compute_start = start;
    stats->queue += start - wait_start;
    uint64_t version;
    absl::Status bounded;
    bool bound_exact;
    {
      // W and the window stay as they are read here until the run is over: a push, an apply
      // or a pull takes this micro-batch's compute lock too.
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
      LOSSHEAD_ASSIGN_OR_RETURN(const float measured, MeasureWeights(devices));
      absl::MutexLock state(&state_mu_);
      weight_abs_ = measured;
      weight_abs_exact_ = true;
      bounded = ReserveStepBounds(p);
    }
    LOSSHEAD_RETURN_IF_ERROR(bounded);
    // Only the 16 bytes of scalars come back under the lock; dH follows on the slot's stream
    // once the lock is free for the next micro-batch's run.
    char scalars[16];
    absl::Status ran;
    if (group_->sharded()) {
      ShardRun shard_run{.problem = p.problem,
                         .grad_weight = !p.forward_only,
                         .grad_hidden = p.want_grad_hidden,
                         .per_token = p.want_per_token};
      LOSSHEAD_RETURN_IF_ERROR(PrepareShards(shard_run));
      ran = RunShards(shard_run, slots);
      if (ran.ok()) {
        ran = replica.backend.CopyToHost(scalars, slot.scalars.data(), 16, *replica.stream);
      }
      if (ran.ok()) ran = group_->Synchronize();
      for (Replica* shard : devices) {
        EndRun(*shard, shard_run.stashes[shard->rank], p.problem.n, ran.ok());
      }
    } else {
      LOSSHEAD_ASSIGN_OR_RETURN(
          const size_t ws_bytes,
          replica.backend.WorkspaceBytes(p.problem, options_.workspace_budget_bytes));
      LOSSHEAD_RETURN_IF_ERROR(EnsureBuffer(replica, replica.workspace, ws_bytes, true));

      kernels::Arguments args;
      args.hidden = slot.hidden.data();
      args.weight = replica.weights.data();
      args.targets = slot.targets.as<int32_t>();
      args.grad_hidden = p.want_grad_hidden ? slot.grad_hidden.data() : nullptr;
      // Forward-only: without dW the backend skips the dW GEMM; the loss and dH are computed the
      // same way, so they match an undeferred counted step's bit for bit.
      if (!p.forward_only) {
        LOSSHEAD_ASSIGN_OR_RETURN(args.grad_stash, StashFor(replica, p.problem));
        if (args.grad_stash.data == nullptr) args.grad_weight = replica.grad.as<float>();
      }
      // token_count first: it needs 8-byte alignment.
      args.token_count = slot.scalars.as<int64_t>();
      args.loss_sum = reinterpret_cast<float*>(slot.scalars.as<char>() + 8);
      args.per_token_loss = p.want_per_token ? slot.per_token.as<float>() : nullptr;
      args.workspace = replica.workspace.data();
      args.workspace_bytes = ws_bytes;
      ran = replica.backend.Run(p.problem, args, *replica.stream);
      if (ran.ok()) {
        ran = replica.backend.CopyToHost(scalars, slot.scalars.data(), 16, *replica.stream);
      }
      if (ran.ok()) ran = replica.stream->Synchronize();
      EndRun(replica, args.grad_stash, p.problem.n, ran.ok());
    }
    if (!ran.ok()) {
      if (p.forward_only) return ran;  // dW was not an argument: nothing can be in it
      // The run may have added some of its chunks to dW before it failed, and there is no exact
      // way to take them out again. The key keeps this answer: a retry must not add them twice.
      absl::Status fault = absl::DataLossError(absl::StrCat(
          "the device failed while running micro-batch ", KeyOf(client_id, sequence), ": ",
          ran.message(),
          "; dW may hold part of it, which the gradient window's counters do not count: pull "
          "with reset to drop the window before the next optimizer step",
          keyed ? "; this key keeps this answer and is never computed again" : ""));
      if (keyed) cache_.Fail(client_id, sequence, fault);
      return fault;
    }
    std::memcpy(&token_count, scalars, 8);
    std::memcpy(&loss_sum, scalars + 8, 4);
    if (!p.forward_only) {
      absl::MutexLock state(&state_mu_);
      tokens_since_pull_ += token_count;
      tokens_total_ += token_count;
      microbatches_since_pull_ += 1;
      microbatches_total_ += 1;
      if (microbatches_since_pull_ == 1) {
        min_version_since_pull_ = max_version_since_pull_ = version;
      } else {
        min_version_since_pull_ = std::min(min_version_since_pull_, version);
        max_version_since_pull_ = std::max(max_version_since_pull_, version);
      }
      NoteCountedLocked();
      // Counted in dW, not yet remembered: a snapshot waits for this outcome (see Snapshot).
      ++pending_outcomes_;
    }
    outcome->weights_version = version;
    outcome->forward_only = p.forward_only;
    stats->compute_end = absl::Now();
    stats->compute += stats->compute_end - start;
    for (const auto& a : assignments) a->Release();
  }
  const absl::Time finish_start = absl::Now();
  absl::Status out = StageOut(p, replica, slot, &grad_hidden, &per_token);
  if (out.ok()) {
    FinishOutcome(p, loss_sum, token_count, std::move(grad_hidden), per_token, outcome.get());
    if (keyed) cache_.Complete(client_id, sequence, outcome);
  } else if (!p.forward_only) {
    // Counted in dW and in the window, without a result: the key keeps this failure (before the
    // snapshot may run, as Complete would), so that no retry counts it a second time.
    out = absl::DataLossError(absl::StrCat(
        "micro-batch ", KeyOf(client_id, sequence), " was counted in dW (", token_count,
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

absl::Status Head::ReserveStepBounds(const Prepared& p) {
  const kernels::StepBounds bounds =
      kernels::BoundStep(p.problem, p.hidden_abs, weight_abs_, p.counted_tokens);
  LOSSHEAD_RETURN_IF_ERROR(kernels::CheckStepBounds(p.problem, bounds, p.hidden_abs, weight_abs_,
                                                    p.grad_hidden_dtype, !p.forward_only));
  if (p.forward_only) return absl::OkStatus();
  const double window = window_grad_abs_ + bounds.grad_weight;
  if (!kernels::WithinRange(window, kernels::DType::kFP32)) {
    return absl::OutOfRangeError(absl::StrCat(
        "the gradient window could overflow: its dW elements are bounded by ", window_grad_abs_,
        " and this micro-batch would add up to ", bounds.grad_weight,
        ", past fp32's 3.4e38; nothing was computed or counted: apply the optimizer or pull with "
        "reset to start a new window"));
  }
  window_grad_abs_ = window;
  return absl::OkStatus();
}

absl::StatusOr<float> Head::MeasureWeights(std::span<Replica* const> held) {
  const size_t esize = kernels::DTypeSize(dtype_);
  float largest = 0;
  for (Replica* r : held) {
    const size_t count = static_cast<size_t>(group_->DeviceRows(*r)) * hidden_size();
    std::string host = TakeTransferBuffer(count * esize);  // overwritten whole by the copy
    absl::Cleanup recycle = [&host] { GiveTransferBuffer(std::move(host)); };
    LOSSHEAD_RETURN_IF_ERROR(
        r->backend.CopyToHost(host.data(), r->weights.data(), count * esize, *r->stream));
    LOSSHEAD_RETURN_IF_ERROR(r->stream->Synchronize());
    largest = std::max(largest, kernels::MaxAbs(dtype_, host.data(), count));
  }
  return largest;
}

void Head::FinishOutcome(const Prepared& p, float loss_sum, int64_t token_count,
                         std::string grad_hidden, const std::vector<float>& per_token,
                         StepOutcome* outcome) const {
  outcome->loss_sum = loss_sum;
  outcome->token_count = token_count;
  outcome->loss = p.problem.options.reduction == kernels::Reduction::kMean
                      ? (token_count > 0 ? static_cast<double>(loss_sum) / token_count : 0.0)
                      : static_cast<double>(loss_sum);
  outcome->grad_hidden_dtype = ToProto(p.grad_hidden_dtype);
  if (p.want_grad_hidden) {
    if (p.grad_hidden_dtype == dtype_) {
      outcome->grad_hidden = std::move(grad_hidden);
    } else {
      outcome->grad_hidden = Convert(dtype_, grad_hidden, p.grad_hidden_dtype);
      results_->Give(std::move(grad_hidden));
    }
    outcome->pool = results_;
  }
  if (p.want_per_token) {
    outcome->per_token_loss.assign(reinterpret_cast<const char*>(per_token.data()),
                                   per_token.size() * sizeof(float));
  }
}

}  // namespace losshead::server
