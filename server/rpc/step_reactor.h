// The Step bidi stream of one call: assembles micro-batches (reactions), runs them on the worker
// pool, each starting once the one before holds the device (so one stream's dW contributions keep
// their order, and one's copy back overlaps the next one's staging and run), and writes each
// micro-batch's responses in request order. While micro-batch k computes, k+1.. are received
// (pipelining) up to ServiceContext::max_inflight_per_stream; then reading pauses.
//
// The method is registered raw (byte buffers both ways): requests are parsed here as gRPC would,
// and responses reference the outcome's dH instead of copying it (server/rpc/step_wire.h).
//
// A header is checked before any of its data is read: an unknown head, a field the head cannot
// serve, a size over --max_microbatch_bytes or no room in Admission get the micro-batch answered
// at once, and the rest of its messages are skipped (StepAssembler).
//
// What a stream holds is bounded in time by two timers, each one grpc::Alarm per stream:
// - Stall (Admission::stall_timeout, T): a micro-batch being received must make progress. Its
//   clock starts at its header and restarts each time it has received another progress step of
//   bytes since the clock last started (one full message's payload, ChunkPayloadBytes of
//   --max_message_bytes); it runs only while a read is waiting for the client. Messages that
//   bring less (empty ones, small pieces) do not restart it. When it reaches T the micro-batch is
//   abandoned: its reservation is released, the micro-batches before it are answered, and the
//   stream ends ABORTED. So a micro-batch of B bytes holds its reservation for at most
//   T x (1 + B / step) of waiting, and one that stops or trickles for at most T past its last
//   step. Each read costs a timestamp, each message an addition and a comparison.
// - Unread (Admission::unread_timeout): a response write that has not completed for that long
//   (the client does not read) ends the call ABORTED at once, naming the micro-batches whose
//   answers it had not delivered, and gives back everything the stream holds. Each write costs a
//   timestamp.
// A malformed stream (a message that does not parse, data outside a micro-batch, a header inside
// one, an end inside one) stops reading, answers every micro-batch it sent whole before the bad
// message (they may be counted already), then ends INVALID_ARGUMENT, as a stalled one ends.
//
// Its definitions, by job: the gRPC reactions and what is read (step_reactor.cc), the stream's
// reservations in Admission (step_reactor_admission.cc), running and answering micro-batches
// (step_reactor_run.cc), and the two timers (step_reactor_timers.cc).
#ifndef LOSSHEAD_SERVER_RPC_STEP_REACTOR_H_
#define LOSSHEAD_SERVER_RPC_STEP_REACTOR_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "server/observability/microbatch_metrics.h"
#include "server/rpc/region_input.h"
#include "server/rpc/service_context.h"
#include "server/rpc/shared_regions.h"
#include "server/rpc/step_assembler.h"
#include "transport/slice_message.h"

namespace losshead::server {

class StepReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // `call` (may be null in tests) gives the call's deadline: a stream cancelled past it ends
  // DEADLINE_EXCEEDED rather than CANCELLED.
  explicit StepReactor(ServiceContext* ctx, grpc::CallbackServerContext* call = nullptr);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override;
  // Client cancel, connection drop or deadline: buffered bytes and admissions are given back at
  // once, and micro-batches not yet started are never computed.
  void OnCancel() override;

  // Shutdown, in two steps so that StepStreams never calls into gRPC under its lock: BeginDrain
  // marks the stream and pins the reactor; EndDrain stops reading, finishes once the queued
  // micro-batches are answered, and unpins.
  void BeginDrain();
  void EndDrain();

 private:
  // Where a micro-batch that came through shared memory gets its dH (docs/same-node.md): the
  // region, held until the answer is encoded, and the range its header named.
  struct SharedDestination {
    std::shared_ptr<SharedRegion> region;
    uint64_t grad_offset = 0;
    uint64_t grad_bytes = 0;
  };
  struct Slot {
    AssembledMicroBatch assembled;
    SharedDestination shared;  // no region: the network path
    // A device region's hidden states and targets, copied out when it runs (no region: they came
    // in the messages or out of a host region).
    RegionInput input;
    bool started = false;
    bool done = false;
    bool head_known = false;  // its head exists: its phases are recorded under the head's label
    std::vector<grpc::ByteBuffer> responses;
    size_t next = 0;
    absl::Time ready;       // fully received
    absl::Time first_send;  // first response handed to gRPC
    absl::Time picked;      // a worker took it
    StepStats stats;        // what Head::Step reported (for --step_trace)
    int code = 0;           // the answer's status code
    bool admitted = false;  // holds one server-wide admission (Admission) until answered
    // Bytes reserved in Admission: its request's until it is computed, then its answer's until
    // the last of them is written.
    size_t reserved = 0;
  };

  // Issues whatever gRPC operations the state allows: the next write, the next read, Finish.
  // Must be called without mu_ (gRPC may run reactions inline).
  void Pump();
  // Pump's steps, in its order: the next response to write (null: none now), whether to read
  // the next request, and the status to finish with once nothing is left to write (nullopt: not
  // yet).
  const grpc::ByteBuffer* NextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool NextReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::optional<grpc::Status> FinishStatusLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Parses the read into message_ but for the hidden states, which stay in the slices until the
  // assembler copies them to their buffer. A message that does not parse ends the call
  // INVALID_ARGUMENT (false) rather than pass for the end of the stream.
  bool ParseReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The client half-closed or the call broke: nothing more is read, and a micro-batch left open
  // is malformed input.
  void CloseReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartNextSlotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker's run of `slot`: its answer, computed or refused (ComputeSlot), recorded in the
  // metrics (RecordSlot), encoded, and handed to the stream (CompleteSlotLocked).
  void RunSlot(std::shared_ptr<Slot> slot);
  struct SlotRun {
    absl::StatusOr<std::shared_ptr<const StepOutcome>> outcome;
    StepStats stats;  // what Head::Step reported
    MicrobatchRecord::Reach reach = MicrobatchRecord::Reach::kNoHead;
    // It took its place on the device: the next one may be running already.
    bool ordered = false;
    // Its dH was written into the client's shared memory region rather than sent.
    bool grad_hidden_shared = false;
  };
  // The answer of `slot`, picked by a worker at `picked`: an error when the call is gone or the
  // micro-batch was refused before it ran, else its head's Step (which starts the next slot as
  // soon as this one holds the device).
  // A slot whose tensors lie in a device region has them copied out first (TakeRegionInput),
  // outside mu_; a refusal of that copy is its answer, nothing computed or counted.
  void ComputeSlot(Slot& slot, absl::Time picked, SlotRun& run);
  void RecordSlot(const Slot& slot, absl::Time picked, const SlotRun& run);
  // Writes a computed answer's dH into the slot's shared memory region, when it came that way.
  void WriteSharedGradHidden(const Slot& slot, SlotRun& run);
  // The slot is answered: its responses wait to be written, its reservation becomes its answer's.
  void CompleteSlotLocked(Slot& slot, std::vector<grpc::ByteBuffer> responses, absl::Time picked,
                          SlotRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stops reading; the stream ends with `status` once the micro-batches it received whole are
  // answered (the first such status stands; none after a cancel).
  void EndLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One parsed request, read at `now`: admission, assembly, the stall clock's progress, and a slot
  // for each micro-batch to answer.
  void ReceiveLocked(StepMessage& message, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EnqueueLocked(AssembledMicroBatch assembled, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The header of a micro-batch about to open, before anything of it is buffered: what can never
  // be served (unknown head, a field the head refuses, over --max_microbatch_bytes) or finds no
  // room in Admission is the refusal to answer it with at once; OK admits it.
  absl::Status AdmitHeaderLocked(const StepMessage& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A header that names shared memory (StepHeader.shared_memory), admitted: the reference is
  // taken out of the header (it is not part of the fingerprint) and checked (the region is the
  // caller's, every range inside it, room for dH). A host region's hidden pieces and targets
  // then come from it as if they had arrived in the message; a device region's are copied out
  // when the micro-batch runs (open_input_, then Slot::input), nothing of them read here. The
  // refusal to answer it with, or OK.
  absl::Status ResolveSharedLocked(StepMessage& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AdmitHeaderLocked's first step: the head a header names, or why it can never be served (the
  // stream's token revoked, no such head, `announced` bytes over --max_microbatch_bytes, a field
  // the head refuses), in that order. `announced`: the bytes the header announces.
  absl::StatusOr<std::shared_ptr<Head>> ServableHeadLocked(const v1::StepHeader& header,
                                                           uint64_t& announced)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Admission bookkeeping of a further message of the open micro-batch, before its bytes are
  // buffered: the refusal to answer it with, or OK.
  absl::Status AdmitPieceLocked(const StepMessage& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The timers (see above). ArmAlarmLocked sets one for `when` (pinning the reactor until it
  // fires or is cancelled); OnStallAlarm abandons the open micro-batch once its clock reached the
  // timeout, or re-arms; OnUnreadAlarm ends the call once the pending write is that old, or
  // re-arms.
  enum Timer { kStall = 0, kUnread = 1, kTimers = 2 };
  void ArmAlarmLocked(Timer timer, absl::Time when) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Arms the stall alarm after a read at `now` while a micro-batch is open, and the unread alarm
  // as a write starts; each only if a timeout is set and it is not armed already.
  void ArmStallLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ArmUnreadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnStallAlarm(bool fired);
  void OnUnreadAlarm(bool fired);
  // The end of a call whose answers are not read: everything the stream holds is given back, the
  // micro-batches not started are dropped, and the status names the micro-batches whose answers
  // were not delivered.
  grpc::Status AbandonUnreadLocked(absl::Duration waited) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every micro-batch whose answer the client has not had, as the unread status names them (the
  // first 16): "; answered, not delivered: ...; started, ...; not computed: ...".
  std::string UndeliveredLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The open micro-batch made no progress for `waited` (>= `timeout`): it is abandoned, its
  // reservation released, and the stream ends ABORTED once those before it are answered.
  void AbandonStalledLocked(absl::Duration waited, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the received micro-batches not yet started (a cancelled or abandoned call).
  void DropUnstartedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseOpenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseSlotBytesLocked(Slot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseSlotLocked(Slot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A computed slot's reservation becomes its answer's `bytes`, held until they are written; all
  // of it is given back when they never will be (the call is cancelled or over).
  void BookAnswerLocked(Slot& slot, size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  grpc::Status CancelStatus() const;
  // The --step_trace line of a micro-batch whose last answer was just written.
  static StepTraceRecord TraceRecord(const Slot& slot);
  // Drops one pin; deletes the reactor when gRPC is done with it and nothing pins it.
  void Unpin();

  ServiceContext* const ctx_;
  grpc::CallbackServerContext* const call_;
  const absl::Time start_;
  // Bytes a micro-batch being received must bring within each stall timeout (see above).
  const size_t progress_step_;
  grpc::ByteBuffer read_buffer_;               // owned by the outstanding read
  StepMessage message_;                        // the last read, parsed
  transport::wire::DataPieces hidden_slices_;  // what message_.hidden points into

  absl::Mutex mu_;
  StepAssembler assembler_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  // A micro-batch of this stream runs and has not yet taken its place on the device: the next
  // one waits, so that the stream's micro-batches reach dW in order.
  bool computing_ ABSL_GUARDED_BY(mu_) = false;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool read_closed_ ABSL_GUARDED_BY(mu_) = false;  // client half-closed or call broken
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish has been called
  std::optional<grpc::Status> pending_finish_ ABSL_GUARDED_BY(mu_);
  grpc::Status final_status_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;     // OnDone ran
  int pins_ ABSL_GUARDED_BY(mu_) = 0;          // worker tasks and drains that still use `this`
  int64_t inflight_ ABSL_GUARDED_BY(mu_) = 0;  // counted in the inflight gauge
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  // The open micro-batch's admission: admitted, bytes reserved and bytes received so far.
  bool open_admitted_ ABSL_GUARDED_BY(mu_) = false;
  size_t open_reserved_ ABSL_GUARDED_BY(mu_) = 0;
  size_t open_received_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t open_announced_ ABSL_GUARDED_BY(mu_) = 0;    // bytes its header announces
  SharedDestination open_shared_ ABSL_GUARDED_BY(mu_);  // its region, when it came that way
  RegionInput open_input_ ABSL_GUARDED_BY(mu_);         // its tensors, when in a device region
  // The timers (see above): when the outstanding read and write were started; the stall clock of
  // the open micro-batch (time waited for reads since it last started, not counting the
  // outstanding read) and the bytes received at which it restarts next; each alarm, and whether
  // it is set and has not run yet.
  absl::Time read_started_ ABSL_GUARDED_BY(mu_);
  absl::Time write_started_ ABSL_GUARDED_BY(mu_);
  absl::Duration stall_waited_ ABSL_GUARDED_BY(mu_);
  size_t progress_at_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<grpc::Alarm> alarms_[kTimers] ABSL_GUARDED_BY(mu_);
  bool alarm_pending_[kTimers] ABSL_GUARDED_BY(mu_) = {false, false};
  // The status the stream ends with once its micro-batches received whole are answered: a stalled
  // micro-batch or malformed input (nothing more is read), or unread answers (the call was
  // cancelled with it).
  std::optional<grpc::Status> end_status_ ABSL_GUARDED_BY(mu_);
  // The call is being cancelled for unread answers, outside mu_: Finish waits until it was.
  bool cancelling_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_STEP_REACTOR_H_
