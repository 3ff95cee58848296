// Micro-batches over one bidirectional Step stream: chunked sends, pipelined, answered in order.
#ifndef LOSSHEAD_CLIENT_STEP_STREAM_H_
#define LOSSHEAD_CLIENT_STEP_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "losshead/client/device_region.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::client {

class SharedRegion;
class DeviceRegion;

// How a stream reaches a server on its own host (docs/same-node.md): the server's same-node
// socket (Stats.same_node) and the authorization its regions are registered with.
struct SameNodeLink {
  std::string socket;
  std::string authorization;  // "Bearer <token>", or empty
};

// One micro-batch: N tokens of hidden states (N x D row-major, `hidden_dtype`) and their target ids
// (N, `target_dtype` INT32 or INT64). The spans are only read during StepStream::Send (copied once,
// into the messages' own buffers).
// (client_id, sequence) is the idempotency key: sending the same key twice returns the first
// answer again without accumulating dW twice.
struct Microbatch {
  // LOSS (default); EMBEDDING_GRAD: `hidden` carries dE rows and `targets` their token ids, for
  // a head tied to its model's input embedding (see the proto; Client::EmbeddingGrad builds one).
  v1::StepKind kind = v1::STEP_KIND_LOSS;
  std::string head;
  std::string client_id;
  uint64_t sequence = 0;
  int64_t num_tokens = 0;
  v1::DType hidden_dtype = v1::DTYPE_BF16;
  std::span<const std::byte> hidden;
  v1::DType target_dtype = v1::DTYPE_INT32;
  std::span<const std::byte> targets;
  // grad_scale, reduction, expected version, per-token loss, ...; forward_only for evaluation
  // (loss and dH without adding to dW or counting; see the proto); token_outputs and
  // return_correct_count and top_k for the predicted distribution's outputs (StepResult).
  v1::StepOptions options;
  v1::LossOptions loss_options;  // overrides of the head's default loss options
  // Per-token fp32 inputs of the loss terms (v1::TokenInput), num_tokens values each when given;
  // an empty one is not sent (and not named in the header). See the proto for which options
  // take which: token_weights with either kind, old_logprob and advantages with
  // LOSS_KIND_POLICY_GRADIENT, ref_logprob with kl_coef > 0.
  std::span<const float> token_weights;
  std::span<const float> old_logprob;
  std::span<const float> advantages;
  std::span<const float> ref_logprob;
  // Where dH goes: unset, into StepResult::grad_hidden; set, straight into this caller's buffer
  // as it arrives (no intermediate copy; StepResult::grad_hidden stays empty), which must stay
  // valid until the answer is received or the stream is destroyed. An answer with more dH bytes
  // than the buffer holds fails INTERNAL.
  std::optional<std::span<std::byte>> grad_hidden_out;
  // The device path (docs/same-node.md): set, the hidden states, targets and room for dH lie in
  // this device region at these offsets (`hidden` and `targets` empty, `grad_hidden_out` unset);
  // the server copies them out of it and writes dH into it, and StepResult::grad_hidden stays
  // empty (StepResult::device). The caller has finished writing them before Send (its stream
  // synchronised) and reads dH once the answer is received.
  struct DeviceTensors {
    std::shared_ptr<const DeviceRegion> region;
    uint64_t hidden_offset = 0;
    uint64_t hidden_bytes = 0;
    uint64_t targets_offset = 0;
    uint64_t targets_bytes = 0;
    uint64_t grad_hidden_offset = 0;
    uint64_t grad_hidden_bytes = 0;  // room for dH; 0 with skip_grad_hidden
  };
  std::optional<DeviceTensors> device;
};

// The status payload that marks an error as one micro-batch's (StepResponse.error: the stream
// went on) rather than the call's.
inline constexpr absl::string_view kMicrobatchErrorPayload = "type.losshead.dev/microbatch";

// Whether `status` is a micro-batch's own error (see kMicrobatchErrorPayload).
bool IsMicrobatchError(const absl::Status& status);

// The answer to one successful micro-batch.
struct StepResult {
  std::string client_id;
  uint64_t sequence = 0;
  double loss_sum = 0;
  int64_t token_count = 0;
  double loss = 0;
  uint64_t weights_version = 0;
  bool replayed = false;
  bool forward_only = false;  // the server ran it forward-only (false from one that cannot)
  v1::DType grad_hidden_dtype = v1::DTYPE_UNSPECIFIED;
  uint64_t grad_hidden_bytes = 0;      // of dH, wherever it went
  std::vector<std::byte> grad_hidden;  // N x D of grad_hidden_dtype; empty with skip_grad_hidden
                                       // or Microbatch::grad_hidden_out
  std::vector<float> per_token_loss;   // N, when return_per_token_loss was set
  // The token outputs asked in options.token_outputs (N each; see v1::TokenOutput), empty when
  // not asked: log p(target), entropy and log-sum-exp of each token's predicted distribution, and
  // its argmax (ignored tokens: 0, 0, lse, -1).
  std::vector<float> per_token_logprob;
  std::vector<float> per_token_entropy;
  std::vector<float> per_token_lse;
  std::vector<int32_t> per_token_argmax;
  // With options.return_correct_count: non-ignored tokens whose argmax is their target (token
  // accuracy = correct_count / token_count).
  std::optional<int64_t> correct_count;
  // With options.top_k = k > 0: per token, the k ids of the largest logits (decreasing, ties by
  // increasing id) and their log-probabilities, N x k row-major each (ignored tokens: -1 and 0);
  // empty otherwise.
  int32_t top_k = 0;
  std::vector<int32_t> top_k_ids;
  std::vector<float> top_k_logprobs;
  // Its hidden states, targets and dH went through shared memory with a server on this host
  // (the same-node path, docs/same-node.md), not in the stream's messages.
  bool shared_memory = false;
  // They went through the micro-batch's device region (Microbatch::device): dH is there.
  bool device = false;
};

// Bytes of a typed vector, for Microbatch spans.
template <typename T>
std::span<const std::byte> AsBytes(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

// A Step call. Send() may be called from several threads (each micro-batch's messages are written
// as one unit) and Receive() from another; answers come back in the order micro-batches were sent.
// A background thread drains the server's answers so that a caller who sends many micro-batches
// before receiving never stalls the server's writes. Per-micro-batch errors come out of Receive()
// with the server's code and the stream stays usable; once the call itself has ended, Receive()
// returns the call's status for every outstanding micro-batch.
class StepStream {
 public:
  // Use Client::OpenStepStream.
  // With `same_node`, micro-batches go through shared memory regions registered with the server
  // (one per micro-batch in flight, reused); when a region cannot be registered the stream
  // falls back to the network path for good (data_path() says which it uses).
  StepStream(std::unique_ptr<grpc::ClientContext> context, grpc::ChannelInterface* channel,
             size_t max_message_bytes, std::shared_ptr<const SameNodeLink> same_node = nullptr);
  ~StepStream();  // cancels the call if Finish() was not called
  StepStream(const StepStream&) = delete;
  StepStream& operator=(const StepStream&) = delete;

  // Writes one micro-batch, split into messages below max_message_bytes. Fails with the call's
  // status (or UNAVAILABLE) when the stream can no longer be written; the micro-batch then still
  // counts as outstanding and Receive() answers it with a failure too. FAILED_PRECONDITION after
  // Finish(). Shapes are not checked here: the server is the authority and answers per micro-batch.
  absl::Status Send(const Microbatch& microbatch);

  // Blocks for the answer to the oldest micro-batch not yet received.
  // FAILED_PRECONDITION when nothing is outstanding.
  absl::StatusOr<StepResult> Receive();

  // Micro-batches sent whose answers have not been returned by Receive().
  size_t outstanding() const;

  // Half-closes, waits for the server to end the call, and returns the call's status. Answers
  // still buffered stay available to Receive().
  absl::Status Finish();

  // Ends the call at once (CANCELLED for the server).
  void Cancel();
  // Half-closes and waits up to `grace` for the server to end the call, then cancels it: for a
  // stream with nothing outstanding that is no longer needed.
  void Close(absl::Duration grace);
  // Whether the call has ended (the server finished it, or it failed or was cancelled).
  bool ended() const;
  // "shared_memory" while micro-batches go through shared memory, else "network".
  const char* data_path() const;

 private:
  void ReadLoop();
  // Every cancellation goes through here, so that the call's CANCELLED is known to be ours.
  void CancelCall();
  // Fails every expected answer still missing with `status`; called once the call has ended.
  void EndCall(const absl::Status& status);
  // A free registered region of at least `bytes` (reused, or registered now); null when the
  // same-node path is not in use or registering failed (which turns it off for this stream).
  std::shared_ptr<SharedRegion> TakeRegion(size_t bytes);

  std::unique_ptr<grpc::ClientContext> context_;
  std::atomic<bool> cancelled_here_{false};
  // Byte buffers rather than typed messages: see raw_message.h.
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream_;
  const size_t max_message_bytes_;
  const std::shared_ptr<const SameNodeLink> same_node_;
  std::atomic<bool> same_node_off_{false};

  std::mutex write_mu_;  // one micro-batch's messages are written without interleaving
  bool writes_done_ = false;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // A micro-batch sent and not yet answered: its key and where its dH goes.
  struct Expected {
    std::string client_id;
    uint64_t sequence = 0;
    std::optional<std::span<std::byte>> grad_hidden_out;
    // What the answer must carry besides dH: a server that ignores the token outputs (older than
    // them) answers without them, which Receive reports rather than returning empty ones.
    int64_t num_tokens = 0;
    std::vector<int> token_outputs;
    bool correct_count = false;
    uint32_t top_k = 0;
    // Its region on the same-node path (null: the network path) and where dH lands in it.
    std::shared_ptr<SharedRegion> region;
    uint64_t grad_offset = 0;
    uint64_t grad_capacity = 0;
    bool device = false;  // the device path: dH lands in the caller's device region
  };
  std::deque<Expected> expected_;
  std::deque<absl::StatusOr<StepResult>> answers_;  // answered, not yet received
  // Registered regions no micro-batch uses now, for the next ones.
  std::vector<std::shared_ptr<SharedRegion>> free_regions_;
  bool ended_ = false;
  absl::Status call_status_;
  std::thread reader_;
};

}  // namespace losshead::client

#endif  // LOSSHEAD_CLIENT_STEP_STREAM_H_
