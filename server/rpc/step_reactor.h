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
// at once, and the rest of its messages are skipped (StepAssembler). A micro-batch being received
// that gets no message for Admission::stall_timeout() while a read waits for one is abandoned:
// its reservation is released, the micro-batches before it are answered, and the stream ends
// ABORTED. The timer is one grpc::Alarm per stream, armed while a micro-batch is open; each read
// costs only a timestamp.
#ifndef LOSSHEAD_SERVER_RPC_STEP_REACTOR_H_
#define LOSSHEAD_SERVER_RPC_STEP_REACTOR_H_

#include <cstddef>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/alarm.h"
#include "grpcpp/grpcpp.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "losshead/v1/slice_message.h"
#include "server/rpc/service_context.h"
#include "server/rpc/step_assembler.h"

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
  struct Slot {
    AssembledMicroBatch assembled;
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
    size_t reserved = 0;    // request bytes reserved in Admission until its tensors are freed
  };

  // Issues whatever gRPC operations the state allows: the next write, the next read, Finish.
  // Must be called without mu_ (gRPC may run reactions inline).
  void Pump();
  void StartNextSlotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunSlot(std::shared_ptr<Slot> slot);
  void FinishLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One parsed request: admission, assembly, and a slot for each micro-batch to answer.
  void ReceiveLocked(StepMessage& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EnqueueLocked(AssembledMicroBatch assembled) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The header of a micro-batch about to open, before anything of it is buffered: what can never
  // be served (unknown head, a field the head refuses, over --max_microbatch_bytes) or finds no
  // room in Admission is the refusal to answer it with at once; OK admits it.
  absl::Status AdmitHeaderLocked(const StepMessage& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Admission bookkeeping of a further message of the open micro-batch, before its bytes are
  // buffered: the refusal to answer it with, or OK.
  absl::Status AdmitPieceLocked(const StepMessage& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The stall timer: ArmStallAlarmLocked sets the alarm for `when` (pinning the reactor until it
  // fires or is cancelled); OnStallAlarm abandons the open micro-batch once a read has waited
  // the whole timeout, or re-arms.
  void ArmStallAlarmLocked(absl::Time when) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnStallAlarm(bool fired);
  void ReleaseOpenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseSlotBytesLocked(Slot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseSlotLocked(Slot& slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  grpc::Status CancelStatus() const;
  // The --step_trace line of a micro-batch whose last answer was just written.
  static StepTraceRecord TraceRecord(const Slot& slot);
  // Drops one pin; deletes the reactor when gRPC is done with it and nothing pins it.
  void Unpin();

  ServiceContext* const ctx_;
  grpc::CallbackServerContext* const call_;
  const absl::Time start_;
  grpc::ByteBuffer read_buffer_;  // owned by the outstanding read
  StepMessage message_;           // the last read, parsed
  v1::wire::DataPieces hidden_slices_;  // what message_.hidden points into

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
  uint64_t open_announced_ ABSL_GUARDED_BY(mu_) = 0;  // bytes its header announces
  // The stall timer (see above): when the outstanding read was started, the alarm, whether it
  // is set and has not run yet, and the status of a stream whose micro-batch stalled.
  absl::Time read_started_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<grpc::Alarm> stall_alarm_ ABSL_GUARDED_BY(mu_);
  bool stall_alarm_pending_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> stalled_ ABSL_GUARDED_BY(mu_);
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_STEP_REACTOR_H_
