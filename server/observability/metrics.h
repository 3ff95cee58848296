// The Prometheus metrics of docs/metrics.md, and nothing else. Thread-safe.
//
// Defined in three files: the families with their names and help, and the removal of a head's
// series (metrics.cc); what is served (metrics_traffic.cc); what is held, the build, checkpoints
// and training values (metrics_state.cc).
#ifndef LOSSHEAD_SERVER_OBSERVABILITY_METRICS_H_
#define LOSSHEAD_SERVER_OBSERVABILITY_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace losshead::server {

struct DeviceMemory {
  uint64_t weights = 0;
  uint64_t gradient = 0;
  uint64_t workspace = 0;
  uint64_t master_weights = 0;   // optimizers' fp32 copies of W
  uint64_t optimizer_state = 0;  // optimizers' moments and momentum buffers
  uint64_t free = 0;
  uint64_t total = 0;
};

class Metrics {
 public:
  Metrics();

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  // The Prometheus text exposition of every metric, as served at /metrics.
  std::string RenderText() const;

  // One finished RPC: duration histogram, rpcs_total{code}, and failures_total{reason} if not OK.
  void RpcFinished(absl::string_view method, int code, absl::Duration duration);
  void StepPhase(const std::string& head, absl::string_view phase, absl::Duration duration);
  // outcome: "ok" | "replayed" | "error". `code` is the error's (failures_total{method="Step"}).
  void Microbatch(const std::string& head, absl::string_view outcome, int code = 0);
  // failures_total{method, reason} alone (a micro-batch for a head that does not exist).
  void Failure(absl::string_view method, int code);
  // A micro-batch abandoned because its stream made no progress for --step_stall_timeout.
  void StalledMicrobatch();
  // A Step stream ended because an answer waited --step_unread_timeout to be written.
  void UnreadAnswerAbort();
  void Tokens(const std::string& head, uint64_t tokens);
  // What a computed micro-batch asked for and ran (issue 43's outputs and loss terms): `tokens`
  // tokens served with the per-token `output` ("logprob", "entropy", "lse", "argmax"); one that
  // asked for the top-k; one that ran loss `kind` ("cross_entropy", "policy_gradient"); one whose
  // loss had `term` ("entropy", "kl", "token_weights").
  void TokenOutputTokens(const std::string& head, absl::string_view output, uint64_t tokens);
  void TopKMicrobatch(const std::string& head);
  void LossKindMicrobatch(const std::string& head, absl::string_view kind);
  void LossTermMicrobatch(const std::string& head, absl::string_view term);
  // Rows of W served by EmbeddingRows, and rows of dE added to dW by EMBEDDING_GRAD micro-batches.
  void EmbeddingRowsServed(const std::string& head, uint64_t rows);
  void EmbeddingGradRows(const std::string& head, uint64_t rows);
  void Bytes(absl::string_view method, absl::string_view direction, uint64_t bytes);
  void InflightAdd(int64_t delta);
  int64_t inflight() const { return inflight_count_.load(); }
  void Pull(const std::string& head);
  // One ApplyOptimizer on `head`: outcome "ok" | "replayed" | "error", and its duration (the
  // failure reasons are RpcFinished's).
  void OptimizerApply(const std::string& head, absl::string_view outcome, absl::Duration duration);
  void Push(const std::string& head);
  // Device memory of one head by kind (DeviceMemory's fields; free and total unused).
  void HeadMemory(const std::string& head, const DeviceMemory& memory);
  // Devices holding one head (1, or its replicas).
  void HeadDevices(const std::string& head, size_t count);
  // Memory of one device of the server, labelled `device` ("cuda:0", "cpu:1": DeviceLabel).
  void DeviceMemoryBytes(const std::string& device, const DeviceMemory& memory);
  // Time `device` spent running micro-batches (the compute phase): a sharded micro-batch counts
  // on every shard's device, a replicated one on the replica that ran it.
  void DeviceBusy(const std::string& device, absl::Duration duration);
  // Host memory of the buffer pools: page-locked receive buffers held (in use or idle) and idle,
  // and dH buffers kept idle for reuse.
  void HostBufferBytes(size_t page_locked_held, size_t page_locked_idle, size_t dh_idle);
  void Heads(size_t count);
  // Bearer tokens in force, and one token-file reload (result "ok" or "error").
  void AuthTokens(size_t count);
  void TokenReload(bool ok, size_t tokens_in_force);
  // One discarded gradient window (PullGradient summary_only with reset) and what it held.
  void GradientDiscard(const std::string& head, uint64_t microbatches, uint64_t tokens);
  // The open gradient window of one head: micro-batches and tokens in it, and the time since its
  // first micro-batch (0 while empty).
  void HeadWindow(const std::string& head, uint64_t microbatches, uint64_t tokens,
                  absl::Duration age);
  // Remembered micro-batch results over every head (server/engine/idempotency_budget.h): how many
  // and their bytes now, and evictions since the start by cause ("window", "client_bytes",
  // "server_bytes", "age": cumulative counts).
  void RememberedResults(size_t results, size_t bytes,
                         const std::vector<std::pair<std::string, uint64_t>>& evictions);
  // Client connections on the gRPC TCP port (server/rpc/connection_guard.h): open now; one
  // accepted; one refused at once (--max_connections reached by connections that all made a call);
  // one closed for `reason` ("displaced": it had made no call and a new connection needed its
  // place; "first_call_timeout").
  void ConnectionsOpen(size_t count);
  void ConnectionAccepted();
  void ConnectionRefused();
  void ConnectionReaped(absl::string_view reason);
  // Step tensor bytes by the path they took (docs/same-node.md): `path` "network" (in the
  // stream's messages) or "shared_memory" (read from or written into a client's region),
  // `direction` "in" or "out".
  void StepDataBytes(absl::string_view path, absl::string_view direction, uint64_t bytes);
  // Same-node shared memory regions mapped now (registered, or still used by a micro-batch after
  // their client left) and their bytes.
  void SharedMemoryMapped(size_t regions, size_t bytes);
  // Drops every series labelled with `head`.
  void RemoveHead(const std::string& head);

  // --- Build, checkpoints and training values: what an operator of a deployment watches. ---
  // losshead_build_info{version, backend, cuda} = 1.
  void BuildInfo(const std::string& version, const std::string& backend, const std::string& cuda);
  // --checkpoint_interval (0: only on demand and at shutdown), and the start-up restore's time.
  void CheckpointInterval(absl::Duration interval);
  void CheckpointRestoreDuration(absl::Duration duration);
  // One head's checkpoint file: written (`bytes`, the write's duration, when it reached the disk),
  // failed, or restored at start (its size and modification time; no write is counted).
  void CheckpointWritten(const std::string& head, uint64_t bytes, absl::Duration duration,
                         absl::Time persisted_at);
  void CheckpointFailed(const std::string& head, absl::Duration duration);
  void CheckpointRestored(const std::string& head, uint64_t bytes, absl::Time persisted_at);
  // A head's weights version and optimizer step count, as read at a scrape.
  void HeadTraining(const std::string& head, uint64_t weights_version, uint64_t optimizer_step);
  // The mean loss per token of a head's last micro-batch of `outcome` ("ok": counted in dW,
  // "forward": evaluation); nothing for a micro-batch whose tokens were all ignored.
  void MicrobatchLoss(const std::string& head, absl::string_view outcome, double loss_sum,
                      int64_t tokens);
  // The last optimizer apply of a head that stepped: its gradient norms (the head's, and with the
  // trunk's) and the clip coefficient it applied.
  void OptimizerNorms(const std::string& head, double head_norm, double total_norm,
                      double clip_coefficient);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Histogram>& rpc_duration_;
  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Family<prometheus::Histogram>& phase_duration_;
  prometheus::Family<prometheus::Counter>& microbatches_;
  prometheus::Family<prometheus::Counter>& tokens_;
  prometheus::Family<prometheus::Counter>& token_output_tokens_;
  prometheus::Family<prometheus::Counter>& top_k_microbatches_;
  prometheus::Family<prometheus::Counter>& loss_kind_microbatches_;
  prometheus::Family<prometheus::Counter>& loss_term_microbatches_;
  prometheus::Family<prometheus::Counter>& embedding_rows_;
  prometheus::Family<prometheus::Counter>& embedding_grad_rows_;
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Gauge>& inflight_family_;
  prometheus::Family<prometheus::Counter>& failures_;
  prometheus::Family<prometheus::Gauge>& head_memory_;
  prometheus::Family<prometheus::Gauge>& head_devices_;
  prometheus::Family<prometheus::Gauge>& device_memory_;
  prometheus::Family<prometheus::Counter>& device_busy_;
  prometheus::Family<prometheus::Gauge>& host_buffers_;
  prometheus::Family<prometheus::Counter>& pulls_;
  prometheus::Family<prometheus::Counter>& pushes_;
  prometheus::Family<prometheus::Counter>& optimizer_applies_;
  prometheus::Family<prometheus::Histogram>& optimizer_apply_duration_;
  prometheus::Family<prometheus::Gauge>& heads_family_;
  prometheus::Family<prometheus::Gauge>& auth_tokens_family_;
  prometheus::Family<prometheus::Counter>& token_reloads_;
  prometheus::Family<prometheus::Counter>& stalls_family_;
  prometheus::Family<prometheus::Counter>& discards_;
  prometheus::Family<prometheus::Counter>& discarded_microbatches_;
  prometheus::Family<prometheus::Counter>& discarded_tokens_;
  prometheus::Family<prometheus::Gauge>& window_microbatches_;
  prometheus::Family<prometheus::Gauge>& window_tokens_;
  prometheus::Family<prometheus::Gauge>& window_age_;
  prometheus::Family<prometheus::Counter>& unread_aborts_family_;
  prometheus::Family<prometheus::Gauge>& remembered_results_;
  prometheus::Family<prometheus::Gauge>& remembered_bytes_;
  prometheus::Family<prometheus::Counter>& remembered_evictions_;
  prometheus::Family<prometheus::Gauge>& connections_open_;
  prometheus::Family<prometheus::Counter>& connections_accepted_;
  prometheus::Family<prometheus::Counter>& connections_refused_;
  prometheus::Family<prometheus::Counter>& connections_reaped_;
  prometheus::Family<prometheus::Counter>& step_data_bytes_;
  prometheus::Family<prometheus::Gauge>& shared_memory_regions_;
  prometheus::Family<prometheus::Gauge>& shared_memory_bytes_;
  // Build, checkpoints and training values.
  prometheus::Family<prometheus::Gauge>& build_info_;
  prometheus::Family<prometheus::Gauge>& checkpoint_interval_family_;
  prometheus::Family<prometheus::Gauge>& checkpoint_restore_family_;
  prometheus::Family<prometheus::Counter>& checkpoint_writes_;
  prometheus::Family<prometheus::Histogram>& checkpoint_duration_;
  prometheus::Family<prometheus::Gauge>& checkpoint_bytes_;
  prometheus::Family<prometheus::Gauge>& checkpoint_last_success_;
  prometheus::Family<prometheus::Gauge>& weights_version_;
  prometheus::Family<prometheus::Gauge>& optimizer_step_;
  prometheus::Family<prometheus::Gauge>& last_loss_;
  prometheus::Family<prometheus::Gauge>& grad_norm_;
  prometheus::Family<prometheus::Gauge>& clip_coefficient_;
  prometheus::Gauge& inflight_;
  prometheus::Gauge& heads_;
  prometheus::Counter& stalls_;
  prometheus::Counter& unread_aborts_;
  std::atomic<int64_t> inflight_count_{0};
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_OBSERVABILITY_METRICS_H_
