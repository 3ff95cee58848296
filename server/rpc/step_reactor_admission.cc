// What a Step stream holds in Admission (step_reactor.h): the open micro-batch's admission and
// reserved bytes, checked at its header and grown with each message, then each slot's until its
// answer is written.
#include <algorithm>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "losshead/v1/wire_dtype.h"
#include "server/rpc/group_control.h"
#include "server/rpc/step_reactor.h"
#include "server/security/auth.h"

namespace losshead::server {

absl::Status StepReactor::AdmitHeaderLocked(const StepMessage& message) {
  const v1::StepHeader& header = message.request.header();
  const size_t piece = message.bytes();
  open_received_ = piece;
  open_announced_ = 0;
  uint64_t announced = 0;
  absl::StatusOr<std::shared_ptr<Head>> head = ServableHeadLocked(header, announced);
  if (!head.ok()) return head.status();
  open_announced_ = announced;
  Admission* admission = ctx_->admission;
  if (admission == nullptr) return absl::OkStatus();
  if (piece > ctx_->max_microbatch_bytes) return absl::OkStatus();  // refused as oversize
  // Reserve what the header announces (capped by the per-micro-batch limit, beyond which the
  // micro-batch is refused anyway), so that a large micro-batch is refused at its first
  // message rather than after much of it has been buffered; and room for its answer, which
  // takes the request's place once computed (more only where dH is asked for in a wider dtype;
  // never more than the whole bound, so that it can always be admitted).
  const uint64_t answer =
      std::min<uint64_t>(AnswerBytes(header, (*head)->hidden_size()), admission->max_bytes());
  const size_t want =
      std::max({static_cast<size_t>(announced), static_cast<size_t>(answer), piece});
  if (!admission->TryAdmit(want)) {
    return admission->Refusal(absl::StrCat("no room to admit a micro-batch of ", want, " bytes"));
  }
  open_admitted_ = true;
  open_reserved_ = want;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Head>> StepReactor::ServableHeadLocked(const v1::StepHeader& header,
                                                                      uint64_t& announced) {
  // What can never be served is refused before any of its data is read, and without a retry
  // hint even when the server is busy, so that nobody is invited to send it again. First the
  // stream's token: streams live long (clients keep them between steps) and a reload may have
  // revoked it since the call was authorised.
  if (call_ != nullptr) {
    if (absl::Status auth =
            AuthorizeOpenCall(ctx_->tokens, "/losshead.v1.LossHead/Step", call_->client_metadata());
        !auth.ok()) {
      return auth;
    }
  }
  absl::StatusOr<std::shared_ptr<Head>> head = ctx_->registry->Get(header.head());
  if (!head.ok()) return head.status();
  // Across processes a client's micro-batches are remembered at its home only: elsewhere they
  // are refused, nothing counted, with the home's address.
  if (ctx_->group != nullptr) LOSSHEAD_RETURN_IF_ERROR(ctx_->group->CheckStep(header));
  announced = AnnouncedBytes(header, (*head)->hidden_size());
  if (announced > ctx_->max_microbatch_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "micro-batch of ", announced, " bytes (as its header announces) exceeds the limit of ",
        ctx_->max_microbatch_bytes, " bytes (--max_microbatch_bytes)"));
  }
  if (absl::Status checked = (*head)->CheckHeader(header); !checked.ok()) return checked;
  return head;
}

absl::Status StepReactor::AdmitPieceLocked(const StepMessage& message) {
  Admission* admission = ctx_->admission;
  const size_t piece = message.bytes();
  if (!assembler_.open() || !assembler_.buffering()) return absl::OkStatus();
  open_received_ += piece;
  // Past the per-micro-batch limit the assembler stops buffering and refuses it permanently.
  if (open_received_ > ctx_->max_microbatch_bytes) return absl::OkStatus();
  if (admission == nullptr || !open_admitted_ || open_received_ <= open_reserved_) {
    return absl::OkStatus();
  }
  const size_t more = open_received_ - open_reserved_;
  if (!admission->TryReserve(more)) {
    ReleaseOpenLocked();
    return admission->Refusal(absl::StrCat("no room to buffer ", more, " more bytes"));
  }
  open_reserved_ += more;
  return absl::OkStatus();
}

absl::Status StepReactor::ResolveSharedLocked(StepMessage& message) {
  v1::StepHeader& header = *message.request.mutable_header();
  const v1::SharedMemoryRef ref = header.shared_memory();
  header.clear_shared_memory();
  if (ctx_->shared_regions == nullptr) {
    return absl::FailedPreconditionError(
        "this server has the same-node path disabled (--same_node=false): send the tensors in "
        "the stream's messages");
  }
  if (message.hidden_bytes > 0 || !message.request.targets().empty()) {
    return absl::InvalidArgumentError(
        "a micro-batch whose header names shared memory carries hidden states or targets in its "
        "messages too");
  }
  const std::string principal =
      call_ != nullptr ? CallerIdentity(ctx_->tokens, call_->client_metadata()) : "";
  absl::StatusOr<std::shared_ptr<SharedRegion>> region =
      ctx_->shared_regions->Resolve(ref.region_id(), ref.region_key(), principal);
  if (!region.ok()) return region.status();
  const SharedRegion& r = **region;
  const bool device = r.device() != nullptr;
  if (device != (ref.kind() == v1::REGION_KIND_DEVICE)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region ", ref.region_id(), " is a ", device ? "device" : "host",
                     " region; the reference names kind ", v1::RegionKind_Name(ref.kind())));
  }
  if (absl::Status s = r.CheckRange("hidden", ref.hidden_offset(), ref.hidden_bytes()); !s.ok()) {
    return s;
  }
  if (absl::Status s = r.CheckRange("targets", ref.targets_offset(), ref.targets_bytes());
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          r.CheckRange("grad_hidden", ref.grad_hidden_offset(), ref.grad_hidden_bytes());
      !s.ok()) {
    return s;
  }
  // Room for dH is checked now, before anything runs: an answer that did not fit would be a
  // micro-batch counted whose dH the client never gets.
  absl::StatusOr<std::shared_ptr<Head>> head = ctx_->registry->Get(header.head());
  if (!head.ok()) return head.status();
  uint64_t grad_bytes = 0;
  if (header.kind() != v1::STEP_KIND_EMBEDDING_GRAD && !header.options().skip_grad_hidden()) {
    const v1::DType grad = header.options().grad_hidden_dtype() != v1::DTYPE_UNSPECIFIED
                               ? header.options().grad_hidden_dtype()
                               : header.hidden_dtype();
    grad_bytes = static_cast<uint64_t>(std::max<int64_t>(header.num_tokens(), 0)) *
                 static_cast<uint64_t>((*head)->hidden_size()) * v1::WireDTypeSize(grad);
  }
  if (ref.grad_hidden_bytes() < grad_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory grad_hidden_bytes ",
                                                   ref.grad_hidden_bytes(), " cannot hold the ",
                                                   grad_bytes, " bytes of this micro-batch's dH"));
  }
  open_shared_ = {.region = *region,
                  .grad_offset = ref.grad_hidden_offset(),
                  .grad_bytes = ref.grad_hidden_bytes()};
  message.hidden.clear();
  if (device) {
    // A device region: its bytes are copied out when the micro-batch is picked to run
    // (RegionInput), on a worker and outside mu_, so that this stream's next messages are read
    // and admitted while a copy runs. They count here as received, for the size limits.
    message.region_bytes = ref.hidden_bytes() + ref.targets_bytes();
    open_input_ = {.region = *std::move(region),
                   .hidden_offset = ref.hidden_offset(),
                   .hidden_bytes = ref.hidden_bytes(),
                   .targets_offset = ref.targets_offset(),
                   .targets_bytes = ref.targets_bytes()};
    return absl::OkStatus();
  }
  // A host region: the assembler copies the hidden states out of it (checking and digesting its
  // own copy, so that a client writing the region meanwhile changes nothing but its own input).
  message.request.mutable_targets()->assign(
      reinterpret_cast<const char*>(r.data() + ref.targets_offset()), ref.targets_bytes());
  if (ref.hidden_bytes() > 0) {
    message.hidden.emplace_back(r.data() + ref.hidden_offset(), ref.hidden_bytes());
  }
  message.hidden_bytes = ref.hidden_bytes();
  message.shared = true;
  ctx_->metrics->Bytes("Step", "in", ref.hidden_bytes() + ref.targets_bytes());
  ctx_->metrics->StepDataBytes("shared_memory", "in", ref.hidden_bytes() + ref.targets_bytes());
  return absl::OkStatus();
}

void StepReactor::ReleaseOpenLocked() {
  open_shared_ = {};
  open_input_ = {};
  if (ctx_->admission != nullptr && (open_admitted_ || open_reserved_ > 0)) {
    ctx_->admission->Release(open_admitted_ ? 1 : 0, open_reserved_);
  }
  open_admitted_ = false;
  open_reserved_ = 0;
}

void StepReactor::ReleaseSlotBytesLocked(Slot& slot) {
  if (ctx_->admission != nullptr && slot.reserved > 0) ctx_->admission->Release(0, slot.reserved);
  slot.reserved = 0;
}

void StepReactor::ReleaseSlotLocked(Slot& slot) {
  ReleaseSlotBytesLocked(slot);
  if (ctx_->admission != nullptr && slot.admitted) ctx_->admission->Release(1, 0);
  slot.admitted = false;
}

void StepReactor::BookAnswerLocked(Slot& slot, size_t bytes) {
  if (ctx_->admission == nullptr || !slot.admitted || cancelled_ || finished_) {
    ReleaseSlotBytesLocked(slot);
    return;
  }
  ctx_->admission->Replace(slot.reserved, bytes);
  slot.reserved = bytes;
}

}  // namespace losshead::server
