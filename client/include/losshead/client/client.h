// C++ client of the losshead v1 service: head management, chunked weight and gradient transfer,
// micro-batch steps, stats and health.
#ifndef LOSSHEAD_CLIENT_CLIENT_H_
#define LOSSHEAD_CLIENT_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "losshead/client/retry.h"
#include "losshead/client/step_stream.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::client {

struct ClientOptions {
  // Largest message sent or accepted. Set it to the server's limit (Stats.max_message_bytes):
  // tensors are split into pieces below it, and the server's chunks must fit in it.
  size_t max_message_bytes = size_t{4} << 20;
  // Largest message accepted, when it differs from max_message_bytes (0: the same): a client
  // that sends small pieces may still accept a server's larger chunks.
  size_t max_receive_message_bytes = 0;
  // Deadline of each unary call and of each whole pull, push or download.
  absl::Duration deadline = absl::Seconds(60);
  // Deadline of a Step stream, from its opening; infinite by default as streams live long.
  absl::Duration stream_deadline = absl::InfiniteDuration();
  // Gives this client its own TCP connection instead of sharing one with other clients to the same
  // target (gRPC pools them by default); several connections carry more bytes than one.
  bool dedicated_connection = false;
  // Insecure when null (and no TLS field below is set); when set, the TLS fields are ignored.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // TLS: on when `tls` or any file below is set. Root CA PEM file (empty: the system's roots);
  // client certificate and key PEM files for mTLS; the name to verify in the server's
  // certificate instead of the target's host (tests, or servers reached by IP).
  bool tls = false;
  std::string tls_root_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
  // Sent on every call as `authorization: Bearer <token>`; empty: none.
  std::string bearer_token;
  // Further metadata sent on every call (lower-case keys), after the bearer token.
  std::vector<std::pair<std::string, std::string>> metadata;
  // Further integer channel arguments (e.g. grpc.initial_reconnect_backoff_ms), applied last;
  // they replace the socket read sizes of transport/channel_args.h where they name them.
  std::vector<std::pair<std::string, int>> channel_args;
  // The same-node path (docs/same-node.md): when the server runs on this host and offers it
  // (Stats.same_node), Step streams move hidden states, targets and dH through shared memory,
  // with only control messages on gRPC; otherwise, or when registering a region fails, they use
  // the network path. Results are the same bit for bit. false: always the network path.
  bool same_node = true;
  // Retries of transient failures; see losshead/client/retry.h for what is retried and why
  // nothing is counted twice. Applies to every method, and per micro-batch to Step and StepMany.
  RetryPolicy retry;
  // A head replicated across server processes (docs/multi-process.md) refuses a client id's
  // micro-batches away from its home with FAILED_PRECONDITION naming the home's address
  // ("home=<address>"): Step then connects there (same options) and sends the micro-batch again,
  // once, and sends that client id's later micro-batches there directly; StepMany does the same
  // per micro-batch (those refused are sent again at their home, in order, after the others), and
  // OpenStepStream(client_id) opens its stream at the home, learnt from a redirect or from the
  // group's members (ProcessControl.Members, asked once per connection). The home's connection
  // does not follow a redirect in turn. A Step stream opened with OpenStepStream() returns the
  // refusal as it is. false: every method returns it.
  bool follow_home_redirect = true;
};

// Bytes of a tensor that needs no typed access on the client side.
using Bytes = std::vector<std::byte>;

struct PushRequest {
  std::string head;
  v1::DType dtype = v1::DTYPE_FP32;  // BF16 | FP16 | FP32; V x D row-major
  std::span<const std::byte> data;
  // A head with an output bias (HeadSpec.bias) takes b too, V values of `dtype`, sent after W in
  // the same stream: W and b change together, in one version. Empty: none (such a head then
  // answers INVALID_ARGUMENT, as a head without a bias does when given one).
  std::span<const std::byte> bias;
  v1::PushMode mode = v1::PUSH_MODE_REPLACE;
  std::optional<uint64_t> expected_weights_version;
};

// A gradient pulled whole: the server's summary and V x D elements of summary.dtype(); for a
// head with an output bias (summary.bias()), db's V elements in `bias` (empty otherwise).
struct PulledGradient {
  v1::GradientSummary summary;
  Bytes data;
  Bytes bias;
};

struct DownloadedWeights {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  uint64_t weights_version = 0;
  Bytes data;
  bool has_bias = false;  // the head has an output bias: b follows W on the wire
  Bytes bias;             // b, V elements of `dtype` (DownloadWeights; empty for the *Into)
};

// Rows of W for token ids (Client::EmbeddingRows): num_rows x hidden_size of `dtype`.
struct FetchedRows {
  int64_t num_rows = 0;
  int64_t hidden_size = 0;
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  uint64_t weights_version = 0;  // every row was read at it
  Bytes data;
};

// Where a transfer writes a tensor: the caller's buffer `data`, or `*owned` (allocated to the
// announced size) when `owned` is not null.
struct Destination {
  std::span<std::byte> data;
  Bytes* owned = nullptr;
};

// grpc.health.v1 serving status.
enum class ServingStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };

// Thread-safe: one Client (one channel) may serve many threads and streams at once. Every method
// returns the server's status code unchanged (see FromGrpcStatus); the client adds INVALID_ARGUMENT
// for requests it can tell are malformed before sending and INTERNAL for answers that break the
// protocol's framing (bad offsets, totals, missing summary).
class Client {
 public:
  // Creates the channel; does not wait for the server (see WaitForReady / Health).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& target,
                                                         const ClientOptions& options = {});

  // True once the channel is connected, DEADLINE_EXCEEDED if it is not within `timeout`.
  absl::Status WaitForReady(absl::Duration timeout);

  absl::StatusOr<v1::HeadInfo> CreateHead(const v1::HeadSpec& spec);
  absl::StatusOr<v1::HeadInfo> GetHead(const std::string& name);
  absl::StatusOr<std::vector<v1::HeadInfo>> ListHeads();
  absl::Status DeleteHead(const std::string& name);
  absl::StatusOr<v1::HeadInfo> SetLossOptions(const std::string& name,
                                              const v1::LossOptions& default_options);

  // Streams W (or a delta, PUSH_MODE_ADD) in pieces below the message limit; returns the new
  // weights version. FAILED_PRECONDITION when expected_weights_version does not match.
  absl::StatusOr<uint64_t> PushWeights(const PushRequest& request);
  // PushWeights with PUSH_MODE_REPLACE and no expected version.
  absl::StatusOr<uint64_t> UploadWeights(const std::string& head, v1::DType dtype,
                                         std::span<const std::byte> data);
  // UNSPECIFIED dtype: the head's weight dtype.
  absl::StatusOr<DownloadedWeights> DownloadWeights(const std::string& head,
                                                    v1::DType dtype = v1::DTYPE_UNSPECIFIED);
  // Reassembles dW (FP32 or BF16) in host memory, checking that the chunks tile it exactly.
  absl::StatusOr<PulledGradient> PullGradient(const std::string& head,
                                              v1::DType dtype = v1::DTYPE_FP32, bool reset = false);
  // PullGradient into the caller's buffer, which must hold V x D elements of `dtype` (more is
  // left untouched): no intermediate copy of dW. FAILED_PRECONDITION when the server announces
  // more bytes than `out` holds (with `reset`, that window is then gone, as after a lost answer).
  // A head with an output bias sends db after dW: without `bias_out` it lands after dW in `out`
  // (which must then hold V x D + V elements), with it in `bias_out` (at least V elements; more
  // left untouched; a head without a bias leaves it untouched). summary.bias() says which.
  absl::StatusOr<v1::GradientSummary> PullGradientInto(const std::string& head, v1::DType dtype,
                                                       bool reset, std::span<std::byte> out);
  absl::StatusOr<v1::GradientSummary> PullGradientInto(const std::string& head, v1::DType dtype,
                                                       bool reset, std::span<std::byte> out,
                                                       std::span<std::byte> bias_out);
  // DownloadWeights into the caller's buffer (the same rules, b for dW's db); `data` and `bias`
  // of the result stay empty, `has_bias` says whether b was written.
  absl::StatusOr<DownloadedWeights> DownloadWeightsInto(const std::string& head, v1::DType dtype,
                                                        std::span<std::byte> out);
  absl::StatusOr<DownloadedWeights> DownloadWeightsInto(const std::string& head, v1::DType dtype,
                                                        std::span<std::byte> out,
                                                        std::span<std::byte> bias_out);

  absl::StatusOr<v1::Stats> GetStats();
  // Writes the checkpoint of `head` (every head when empty) now; FAILED_PRECONDITION when the
  // server runs without --checkpoint_dir. Safe to repeat.
  absl::StatusOr<v1::CheckpointResponse> Checkpoint(const std::string& head = "");
  // Highest applied ("acknowledged") and checkpointed ("persisted") sequence of `client_id` on
  // `head`. After a server restart, resend exactly the micro-batches above persisted_sequence
  // (see the proto for when that is exact).
  absl::StatusOr<v1::ClientProgress> GetClientProgress(const std::string& head,
                                                       const std::string& client_id);

  // The open gradient window's summary without its data (PullGradientRequest.summary_only); a
  // read, retried like one.
  absl::StatusOr<v1::GradientSummary> WindowSummary(const std::string& head);
  // Discards the window without moving dW (summary_only with reset: a trainer's zero_grad) and
  // returns what it held. Never re-sent once it may have reached the server, as a pull with reset
  // (a repeat would drop micro-batches sent after the first): only the wait for the server is
  // retried.
  absl::StatusOr<v1::GradientSummary> DiscardGradient(const std::string& head);

  // Named snapshots (see the proto): SnapshotHead writes the head's snapshot `tag` (a Checkpoint
  // with a tag), RestoreHead puts the head back to it, and the two others prune them. All retried
  // (a repeat writes or restores the same again; a DeleteSnapshot repeat that finds the snapshot
  // gone after an attempt whose answer was lost is OK).
  absl::StatusOr<v1::SnapshotInfo> SnapshotHead(const std::string& head, const std::string& tag);
  absl::StatusOr<v1::HeadInfo> RestoreHead(const std::string& head, const std::string& tag);
  absl::Status DeleteSnapshot(const std::string& head, const std::string& tag);
  absl::StatusOr<std::vector<v1::SnapshotInfo>> ListSnapshots(const std::string& head);

  // The server-side optimizer (see the proto). SetOptimizer replaces the head's optimizer (state
  // afresh) and returns its info. ApplyOptimizer steps it over the gradient window exactly once
  // per (client_id, step_key): retried like any call, as a repeat that reached the server is
  // answered from its record (replayed = true) without stepping again. Choose keys that increase
  // per client id; after a lost answer, GetHead().optimizer_step() tells whether it stepped.
  absl::StatusOr<v1::HeadInfo> SetOptimizer(const std::string& head,
                                            const v1::OptimizerSpec& optimizer);
  absl::StatusOr<v1::ApplyOptimizerResponse> ApplyOptimizer(
      const v1::ApplyOptimizerRequest& request);

  // grpc.health.v1.Health/Check; an empty `service` asks about the server as a whole.
  absl::StatusOr<ServingStatus> Health(const std::string& service = "");

  // A head tied to its model's input embedding (StepKind in the proto). EmbeddingRows reads the
  // rows of W for `ids` (each in [0, V)) in `dtype` (UNSPECIFIED: the head's), retried like any
  // read; the ids must fit one message (INVALID_ARGUMENT before sending otherwise: split them).
  // EmbeddingGrad adds `grad` (ids.size() x D of `grad_dtype`) into the head's dW window as an
  // EMBEDDING_GRAD micro-batch under (client_id, sequence): exactly once, retried like Step.
  absl::StatusOr<FetchedRows> EmbeddingRows(
      const std::string& head, std::span<const int64_t> ids,
      v1::DType dtype = v1::DTYPE_UNSPECIFIED,
      std::optional<uint64_t> expected_weights_version = std::nullopt);
  absl::StatusOr<StepResult> EmbeddingGrad(const std::string& head, const std::string& client_id,
                                           uint64_t sequence, std::span<const int64_t> ids,
                                           v1::DType grad_dtype, std::span<const std::byte> grad);

  // Opens a Step stream (see StepStream).
  absl::StatusOr<std::unique_ptr<StepStream>> OpenStepStream();
  // Opens a Step stream for the micro-batches of `client_id`: at its home process when the server
  // is one of a group holding the head together (ClientOptions::follow_home_redirect), else here.
  absl::StatusOr<std::unique_ptr<StepStream>> OpenStepStream(const std::string& client_id);
  // One micro-batch: its result or its error, with the server's code. Step and StepMany keep
  // their streams open for the next call (when stream_deadline is infinite, as by default):
  // a trainer stepping every few milliseconds does not pay a new call, a reader thread and a
  // cold flow-control window each time.
  absl::StatusOr<StepResult> Step(const Microbatch& microbatch);
  // Micro-batches over Step streams, up to `pipeline_depth` in flight, one answer per micro-batch
  // in the same order. A micro-batch answered with a retryable error, or lost with its stream, is
  // re-sent (same client_id and sequence, on a new stream if the old one ended) after a backoff;
  // a permanent error is its answer. With pipeline_depth 1 dW accumulates in the given order;
  // deeper, a retried micro-batch may land after later ones.
  std::vector<absl::StatusOr<StepResult>> StepMany(std::span<const Microbatch> microbatches,
                                                   size_t pipeline_depth = 4);

  // The path Step streams opened now take to the server (every head alike): "shared_memory" when
  // the server is on this host and offers the same-node path (asked once, with GetStats), else
  // "network". A stream that cannot register a region falls back on its own
  // (StepStream::data_path, StepResult::shared_memory).
  std::string data_path();

  // The device path (docs/same-node.md): the server's devices where a device region opens, asked
  // once as data_path() is; empty when the server offers none, is not on this host, or
  // options().same_node is false. A caller whose buffer lies on one of them (the same PCI bus id)
  // or on a peer of one registers it with RegisterDeviceRegion and names it in
  // Microbatch::device; others stay on the host or network path.
  std::vector<SameNodeDevice> SameNodeDevices();
  // Registers [offset, offset + bytes) of the caller's CUDA allocation of `ipc_handle` (its
  // cudaIpcMemHandle_t's bytes), on the device of `pci_bus_id`, with this client's server
  // (DeviceRegion::Register; its refusals). FAILED_PRECONDITION when there is no same-node path.
  absl::StatusOr<std::shared_ptr<DeviceRegion>> RegisterDeviceRegion(std::string_view ipc_handle,
                                                                     uint64_t offset,
                                                                     uint64_t bytes,
                                                                     const std::string& pci_bus_id);

  // Attempts that were retries (all methods), since Connect.
  uint64_t retries() const { return retries_.load(); }

  // Replaces options().bearer_token for calls that start from now on (calls and streams already
  // open keep theirs; the Step streams kept between StepMany calls are closed, so the next steps
  // carry the new token): after the server's token file was rotated, a trainer switches without
  // reconnecting. Empty: no token. Safe to call while other threads use the client.
  void SetBearerToken(std::string token);

  // The options given to Connect (bearer_token as given there, see SetBearerToken).
  const ClientOptions& options() const { return options_; }
  grpc::Channel* channel() const { return channel_.get(); }

  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

 private:
  Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options);
  // A Step stream for Step and StepMany: one left open by an earlier call, else a new one.
  absl::StatusOr<std::unique_ptr<StepStream>> TakeStepStream();
  // Keeps `stream` for the next call when it can serve one (nothing outstanding, the call still
  // open, no deadline); closes it otherwise.
  void ReturnStepStream(std::unique_ptr<StepStream> stream);
  // Closes the streams kept by ReturnStepStream (new ones open with the current token).
  void CloseIdleStreams();
  std::unique_ptr<grpc::ClientContext> NewContext(absl::Duration deadline) const;
  // Runs `attempt` until it succeeds, fails permanently or options_.retry is spent, sleeping the
  // backoff between attempts; returns the last status.
  absl::Status RunWithRetry(absl::FunctionRef<absl::Status()> attempt);
  // RunWithRetry for a call that returns a value: the last attempt's result.
  template <typename T>
  absl::StatusOr<T> RetryCall(absl::FunctionRef<absl::StatusOr<T>()> attempt);
  // Sleeps the backoff of the `attempt`-th failure and counts a retry.
  void Backoff(int attempt, const absl::Status& status);
  // Health/Check with its own deadline; with `wait_for_ready` it waits for a connection.
  absl::StatusOr<ServingStatus> HealthCheck(const std::string& service, absl::Duration deadline,
                                            bool wait_for_ready);
  // Waits, with the retry policy's backoff, until the server answers a health probe (an answer
  // proves the connection alive, unlike the channel's state); gives up quietly when the policy
  // is spent.
  void WaitForServer();

  // Single attempts of the public methods (the public ones add the retries).
  absl::StatusOr<v1::HeadInfo> CreateHeadOnce(const v1::HeadSpec& spec);
  absl::StatusOr<v1::HeadInfo> GetHeadOnce(const std::string& name);
  absl::StatusOr<std::vector<v1::HeadInfo>> ListHeadsOnce();
  absl::Status DeleteHeadOnce(const std::string& name);
  absl::StatusOr<v1::HeadInfo> SetLossOptionsOnce(const std::string& name,
                                                  const v1::LossOptions& default_options);
  absl::StatusOr<uint64_t> PushWeightsOnce(const PushRequest& request);
  // The transfers write W (dW) into `out` and, for a head with an output bias, b (db) into
  // `bias` when it is given, else after W into `out`.
  absl::StatusOr<DownloadedWeights> DownloadWeightsOnce(const std::string& head, v1::DType dtype,
                                                        Destination out,
                                                        std::optional<Destination> bias);
  absl::StatusOr<v1::GradientSummary> PullGradientOnce(const std::string& head, v1::DType dtype,
                                                       bool reset, Destination out,
                                                       std::optional<Destination> bias);
  // PullGradient's retry rules around PullGradientOnce.
  absl::StatusOr<v1::GradientSummary> PullGradientWithRetry(const std::string& head,
                                                            v1::DType dtype, bool reset,
                                                            Destination out,
                                                            std::optional<Destination> bias);
  absl::StatusOr<v1::Stats> GetStatsOnce();
  // One summary_only pull (WindowSummary, DiscardGradient).
  absl::StatusOr<v1::GradientSummary> WindowSummaryOnce(const std::string& head, bool reset);
  absl::StatusOr<StepResult> StepOnce(const Microbatch& microbatch);
  // The same-node link for a new Step stream, negotiated at the first call (null: the network
  // path); a GetStats that fails is asked again next time.
  std::shared_ptr<const SameNodeLink> SameNode();
  absl::StatusOr<FetchedRows> EmbeddingRowsOnce(const v1::EmbeddingRowsRequest& request);
  // The client of `client_id`'s home process once it is known (a redirect followed, or the
  // group's members); null until then, and for a server that is not one of a group.
  Client* KnownHome(const std::string& client_id);
  // The client of the home at `address` (connected now with these options, except that it does
  // not follow redirects, or reused), remembered as `client_id`'s; null when it cannot connect.
  Client* FollowHome(const std::string& client_id, const std::string& address);
  // `client_id`'s home from the group's members (asked once; a server that is not one of a group
  // has none): KnownHome's client, or null when the home is this process or not known.
  Client* HomeFromMembers(const std::string& client_id);

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::LossHead::Stub> stub_;
  ClientOptions options_;
  mutable absl::Mutex token_mu_;
  std::string bearer_token_ ABSL_GUARDED_BY(token_mu_);
  std::atomic<uint64_t> retries_{0};
  // The clients of the homes Step was redirected to, by address, and each client id's home.
  absl::Mutex homes_mu_;
  std::map<std::string, std::unique_ptr<Client>> home_clients_ ABSL_GUARDED_BY(homes_mu_);
  std::map<std::string, Client*> home_of_ ABSL_GUARDED_BY(homes_mu_);
  // The group's gRPC addresses by rank and the rank of the process this client is connected to,
  // from ProcessControl.Members (empty: not asked yet, or not a group).
  absl::Mutex members_mu_;
  bool members_asked_ ABSL_GUARDED_BY(members_mu_) = false;
  std::vector<std::string> members_ ABSL_GUARDED_BY(members_mu_);
  int member_rank_ ABSL_GUARDED_BY(members_mu_) = -1;
  absl::Mutex streams_mu_;
  std::vector<std::unique_ptr<StepStream>> idle_streams_ ABSL_GUARDED_BY(streams_mu_);
  absl::Mutex same_node_mu_;
  bool same_node_probed_ ABSL_GUARDED_BY(same_node_mu_) = false;
  std::string same_node_socket_ ABSL_GUARDED_BY(same_node_mu_);  // empty: none
  std::vector<SameNodeDevice> same_node_devices_ ABSL_GUARDED_BY(same_node_mu_);
};

// The home's address in a FAILED_PRECONDITION that redirects a client id ("home=<address>"), if
// `status` is one.
std::optional<std::string> HomeRedirect(const absl::Status& status);

// Payload bytes that fit in one message next to `overhead` bytes of other fields.
size_t PieceBytes(size_t max_message_bytes, size_t overhead);

}  // namespace losshead::client

#endif  // LOSSHEAD_CLIENT_CLIENT_H_
