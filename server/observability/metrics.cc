#include "server/observability/metrics.h"

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace losshead::server {
namespace {

// The kinds of memory heads hold, by label value: the series of head_memory and device_memory.
std::array<std::pair<const char*, uint64_t>, 5> HeldKinds(const DeviceMemory& m) {
  return {{{"weights", m.weights},
           {"gradient", m.gradient},
           {"workspace", m.workspace},
           {"master_weights", m.master_weights},
           {"optimizer_state", m.optimizer_state}}};
}

// Seconds, from 0.1 ms (a tiny micro-batch's queue wait) to 60 s (a 2 GiB pull on a slow link).
const prometheus::Histogram::BucketBoundaries& Buckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
      0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
  return *buckets;
}

// Seconds, from 10 ms (a small head on a local disk) to 10 minutes (tens of GiB of W, dW and
// optimizer state fsynced to network storage).
const prometheus::Histogram::BucketBoundaries& CheckpointBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
  return *buckets;
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// "ok", "invalid_argument", ...: the value of losshead_rpcs_total{code} and of
// losshead_failures_total{reason}, one spelling for both so that they join and compare as they
// are (absl and gRPC share the numeric codes).
std::string CodeName(int code) {
  return absl::AsciiStrToLower(absl::StatusCodeToString(static_cast<absl::StatusCode>(code)));
}
std::string ReasonName(int code) { return CodeName(code); }

}  // namespace

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      rpc_duration_(prometheus::BuildHistogram()
                        .Name("losshead_rpc_duration_seconds")
                        .Help("Wall time of each RPC, from start to final status")
                        .Register(*registry_)),
      rpcs_(prometheus::BuildCounter()
                .Name("losshead_rpcs_total")
                .Help("Finished RPCs by gRPC status code")
                .Register(*registry_)),
      phase_duration_(prometheus::BuildHistogram()
                          .Name("losshead_step_phase_duration_seconds")
                          .Help("Per micro-batch phase durations: receive, queue, compute, send")
                          .Register(*registry_)),
      microbatches_(prometheus::BuildCounter()
                        .Name("losshead_microbatches_total")
                        .Help("Micro-batches by outcome: ok, forward, replayed, error")
                        .Register(*registry_)),
      tokens_(prometheus::BuildCounter()
                  .Name("losshead_tokens_total")
                  .Help("Non-ignored tokens computed, forward-only included (replays not counted)")
                  .Register(*registry_)),
      bytes_(prometheus::BuildCounter()
                 .Name("losshead_bytes_total")
                 .Help("Tensor payload bytes received (in) and sent (out)")
                 .Register(*registry_)),
      inflight_family_(prometheus::BuildGauge()
                           .Name("losshead_inflight_microbatches")
                           .Help("Micro-batches received completely and not yet answered")
                           .Register(*registry_)),
      failures_(prometheus::BuildCounter()
                    .Name("losshead_failures_total")
                    .Help("Failed micro-batches and RPCs by reason")
                    .Register(*registry_)),
      head_memory_(prometheus::BuildGauge()
                       .Name("losshead_head_memory_bytes")
                       .Help("Device memory of one head by kind, over all of its devices")
                       .Register(*registry_)),
      head_devices_(prometheus::BuildGauge()
                        .Name("losshead_head_devices")
                        .Help("Devices holding one head: 1, or its replicas")
                        .Register(*registry_)),
      device_memory_(prometheus::BuildGauge()
                         .Name("losshead_device_memory_bytes")
                         .Help("Memory of each device by kind: weights, gradient, workspace, "
                               "master_weights, optimizer_state, free, total")
                         .Register(*registry_)),
      device_busy_(prometheus::BuildCounter()
                       .Name("losshead_device_busy_seconds_total")
                       .Help("Time each device spent running micro-batches (compute phase)")
                       .Register(*registry_)),
      host_buffers_(prometheus::BuildGauge()
                        .Name("losshead_host_buffer_bytes")
                        .Help("Host memory of the server's buffer pools: page_locked receive "
                              "buffers (held: in use or idle; idle: kept for reuse), dh results "
                              "kept idle for reuse; each pool keeps at most --max_inflight_bytes "
                              "idle")
                        .Register(*registry_)),
      pulls_(prometheus::BuildCounter()
                 .Name("losshead_pulls_total")
                 .Help("Gradient pulls")
                 .Register(*registry_)),
      pushes_(prometheus::BuildCounter()
                  .Name("losshead_pushes_total")
                  .Help("Weight pushes")
                  .Register(*registry_)),
      optimizer_applies_(prometheus::BuildCounter()
                             .Name("losshead_optimizer_applies_total")
                             .Help("Server-side optimizer applies by outcome: ok, replayed, error")
                             .Register(*registry_)),
      optimizer_apply_duration_(prometheus::BuildHistogram()
                                    .Name("losshead_optimizer_apply_duration_seconds")
                                    .Help("Wall time of one optimizer apply on its head")
                                    .Register(*registry_)),
      heads_family_(prometheus::BuildGauge()
                        .Name("losshead_heads")
                        .Help("Heads on the server")
                        .Register(*registry_)),
      auth_tokens_family_(prometheus::BuildGauge()
                              .Name("losshead_auth_tokens")
                              .Help("Bearer tokens in force (absent without a token file)")
                              .Register(*registry_)),
      token_reloads_(prometheus::BuildCounter()
                         .Name("losshead_auth_token_reloads_total")
                         .Help("Re-reads of the token file by result: ok, error (old tokens kept)")
                         .Register(*registry_)),
      stalls_family_(prometheus::BuildCounter()
                         .Name("losshead_stalled_microbatches_total")
                         .Help("Micro-batches abandoned after --step_stall_timeout without "
                               "progress (reservation released, stream ended ABORTED)")
                         .Register(*registry_)),
      discards_(prometheus::BuildCounter()
                    .Name("losshead_gradient_discards_total")
                    .Help("Gradient windows discarded without being pulled (zero_grad)")
                    .Register(*registry_)),
      discarded_microbatches_(prometheus::BuildCounter()
                                  .Name("losshead_discarded_microbatches_total")
                                  .Help("Micro-batches in the discarded gradient windows")
                                  .Register(*registry_)),
      discarded_tokens_(prometheus::BuildCounter()
                            .Name("losshead_discarded_tokens_total")
                            .Help("Tokens in the discarded gradient windows")
                            .Register(*registry_)),
      window_microbatches_(prometheus::BuildGauge()
                               .Name("losshead_window_microbatches")
                               .Help("Micro-batches in the head's open gradient window")
                               .Register(*registry_)),
      window_tokens_(prometheus::BuildGauge()
                         .Name("losshead_window_tokens")
                         .Help("Tokens in the head's open gradient window")
                         .Register(*registry_)),
      window_age_(prometheus::BuildGauge()
                      .Name("losshead_window_age_seconds")
                      .Help("Seconds since the first micro-batch of the head's open gradient "
                            "window (0 while empty)")
                      .Register(*registry_)),
      unread_aborts_family_(prometheus::BuildCounter()
                                .Name("losshead_unread_answer_aborts_total")
                                .Help("Step streams ended ABORTED because an answer waited "
                                      "--step_unread_timeout to be written (the client did not "
                                      "read); their admissions and bytes were released")
                                .Register(*registry_)),
      remembered_results_(prometheus::BuildGauge()
                              .Name("losshead_idempotency_results")
                              .Help("Micro-batch results remembered for replay, over every head")
                              .Register(*registry_)),
      remembered_bytes_(prometheus::BuildGauge()
                            .Name("losshead_idempotency_bytes")
                            .Help("Bytes of the remembered results (bounded by "
                                  "--idempotency_total_bytes)")
                            .Register(*registry_)),
      remembered_evictions_(prometheus::BuildCounter()
                                .Name("losshead_idempotency_evictions_total")
                                .Help("Remembered results evicted, by cause: window, "
                                      "client_bytes, server_bytes, age")
                                .Register(*registry_)),
      connections_open_(prometheus::BuildGauge()
                            .Name("losshead_connections_open")
                            .Help("Client connections open on the gRPC TCP port")
                            .Register(*registry_)),
      connections_accepted_(prometheus::BuildCounter()
                                .Name("losshead_connections_accepted_total")
                                .Help("Client connections accepted on the gRPC TCP port")
                                .Register(*registry_)),
      connections_refused_(prometheus::BuildCounter()
                               .Name("losshead_connections_refused_total")
                               .Help("Connections closed at once: --max_connections were open "
                                     "and every one had made a call")
                               .Register(*registry_)),
      connections_reaped_(prometheus::BuildCounter()
                              .Name("losshead_connections_reaped_total")
                              .Help("Connections closed before they made a call, by reason: "
                                    "displaced (a new one needed the place at "
                                    "--max_connections), first_call_timeout")
                              .Register(*registry_)),
      build_info_(prometheus::BuildGauge()
                      .Name("losshead_build_info")
                      .Help("1, labelled with the server's version, backend and the CUDA toolkit "
                            "it was built with (none: CPU only)")
                      .Register(*registry_)),
      checkpoint_interval_family_(prometheus::BuildGauge()
                                      .Name("losshead_checkpoint_interval_seconds")
                                      .Help("--checkpoint_interval (0: on demand and at "
                                            "shutdown only; absent without --checkpoint_dir)")
                                      .Register(*registry_)),
      checkpoint_restore_family_(prometheus::BuildGauge()
                                     .Name("losshead_checkpoint_restore_duration_seconds")
                                     .Help("Time the start-up restore of every checkpointed "
                                           "head took, before the server began serving")
                                     .Register(*registry_)),
      checkpoint_writes_(prometheus::BuildCounter()
                             .Name("losshead_checkpoint_writes_total")
                             .Help("Checkpoint file writes per head by result: ok, error")
                             .Register(*registry_)),
      checkpoint_duration_(prometheus::BuildHistogram()
                               .Name("losshead_checkpoint_duration_seconds")
                               .Help("Snapshot + write + fsync + rename of one head's checkpoint")
                               .Register(*registry_)),
      checkpoint_bytes_(prometheus::BuildGauge()
                            .Name("losshead_checkpoint_bytes")
                            .Help("Size of each head's last checkpoint file")
                            .Register(*registry_)),
      checkpoint_last_success_(prometheus::BuildGauge()
                                   .Name("losshead_checkpoint_last_success_timestamp_seconds")
                                   .Help("Unix time at which each head's state last reached "
                                         "its checkpoint file (a restored head: the file's)")
                                   .Register(*registry_)),
      weights_version_(prometheus::BuildGauge()
                           .Name("losshead_head_weights_version")
                           .Help("Each head's weights version (+1 per push and optimizer step)")
                           .Register(*registry_)),
      optimizer_step_(prometheus::BuildGauge()
                          .Name("losshead_optimizer_step")
                          .Help("Each head's server-side optimizer step count")
                          .Register(*registry_)),
      last_loss_(prometheus::BuildGauge()
                     .Name("losshead_head_last_loss")
                     .Help("Mean loss per token of each head's last micro-batch, by outcome: ok "
                           "(counted in dW), forward (evaluation)")
                     .Register(*registry_)),
      grad_norm_(prometheus::BuildGauge()
                     .Name("losshead_optimizer_grad_norm")
                     .Help("Gradient norm of each head's last optimizer step: scope head (dW / "
                           "divisor), total (with the trunk's)")
                     .Register(*registry_)),
      clip_coefficient_(prometheus::BuildGauge()
                            .Name("losshead_optimizer_clip_coefficient")
                            .Help("Clip coefficient of each head's last optimizer step (1: not "
                                  "clipped)")
                            .Register(*registry_)),
      inflight_(inflight_family_.Add({})),
      heads_(heads_family_.Add({})),
      stalls_(stalls_family_.Add({})),
      unread_aborts_(unread_aborts_family_.Add({})) {
  // Present from the start at 0, so that a rate over them is defined before the first event.
  connections_open_.Add({});
  connections_accepted_.Add({});
  connections_refused_.Add({});
  for (const char* reason : {"displaced", "first_call_timeout"}) {
    connections_reaped_.Add({{"reason", reason}});
  }
}

std::string Metrics::RenderText() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

void Metrics::RpcFinished(absl::string_view method, int code, absl::Duration duration) {
  const std::string m(method);
  rpc_duration_.Add({{"method", m}}, Buckets()).Observe(Seconds(duration));
  rpcs_.Add({{"method", m}, {"code", CodeName(code)}}).Increment();
  if (code != 0) failures_.Add({{"method", m}, {"reason", ReasonName(code)}}).Increment();
}

void Metrics::StepPhase(const std::string& head, absl::string_view phase, absl::Duration d) {
  phase_duration_.Add({{"head", head}, {"phase", std::string(phase)}}, Buckets())
      .Observe(Seconds(d));
}

void Metrics::Microbatch(const std::string& head, absl::string_view outcome, int code) {
  microbatches_.Add({{"head", head}, {"outcome", std::string(outcome)}}).Increment();
  if (code != 0) failures_.Add({{"method", "Step"}, {"reason", ReasonName(code)}}).Increment();
}

void Metrics::Failure(absl::string_view method, int code) {
  failures_.Add({{"method", std::string(method)}, {"reason", ReasonName(code)}}).Increment();
}

void Metrics::StalledMicrobatch() { stalls_.Increment(); }

void Metrics::UnreadAnswerAbort() { unread_aborts_.Increment(); }

void Metrics::Tokens(const std::string& head, uint64_t tokens) {
  tokens_.Add({{"head", head}}).Increment(static_cast<double>(tokens));
}

void Metrics::Bytes(absl::string_view method, absl::string_view direction, uint64_t bytes) {
  bytes_.Add({{"method", std::string(method)}, {"direction", std::string(direction)}})
      .Increment(static_cast<double>(bytes));
}

void Metrics::InflightAdd(int64_t delta) {
  inflight_count_ += delta;
  inflight_.Increment(static_cast<double>(delta));
}

void Metrics::Pull(const std::string& head) { pulls_.Add({{"head", head}}).Increment(); }
void Metrics::Push(const std::string& head) { pushes_.Add({{"head", head}}).Increment(); }

void Metrics::OptimizerApply(const std::string& head, absl::string_view outcome,
                             absl::Duration duration) {
  optimizer_applies_.Add({{"head", head}, {"outcome", std::string(outcome)}}).Increment();
  optimizer_apply_duration_.Add({{"head", head}}, Buckets()).Observe(Seconds(duration));
}

void Metrics::HeadMemory(const std::string& head, const DeviceMemory& m) {
  for (const auto& [kind, bytes] : HeldKinds(m)) {
    head_memory_.Add({{"head", head}, {"kind", kind}}).Set(static_cast<double>(bytes));
  }
}

void Metrics::HeadDevices(const std::string& head, size_t count) {
  head_devices_.Add({{"head", head}}).Set(static_cast<double>(count));
}

void Metrics::DeviceMemoryBytes(const std::string& device, const DeviceMemory& m) {
  auto set = [&](const char* kind, uint64_t bytes) {
    device_memory_.Add({{"device", device}, {"kind", kind}}).Set(static_cast<double>(bytes));
  };
  for (const auto& [kind, bytes] : HeldKinds(m)) set(kind, bytes);
  set("free", m.free);
  set("total", m.total);
}

void Metrics::DeviceBusy(const std::string& device, absl::Duration duration) {
  device_busy_.Add({{"device", device}}).Increment(Seconds(duration));
}

void Metrics::HostBufferBytes(size_t page_locked_held, size_t page_locked_idle, size_t dh_idle) {
  host_buffers_.Add({{"pool", "page_locked"}, {"state", "held"}})
      .Set(static_cast<double>(page_locked_held));
  host_buffers_.Add({{"pool", "page_locked"}, {"state", "idle"}})
      .Set(static_cast<double>(page_locked_idle));
  host_buffers_.Add({{"pool", "dh"}, {"state", "idle"}}).Set(static_cast<double>(dh_idle));
}

void Metrics::Heads(size_t count) { heads_.Set(static_cast<double>(count)); }

void Metrics::AuthTokens(size_t count) {
  auth_tokens_family_.Add({}).Set(static_cast<double>(count));
}

void Metrics::TokenReload(bool ok, size_t tokens_in_force) {
  token_reloads_.Add({{"result", ok ? "ok" : "error"}}).Increment();
  AuthTokens(tokens_in_force);
}

void Metrics::GradientDiscard(const std::string& head, uint64_t microbatches, uint64_t tokens) {
  discards_.Add({{"head", head}}).Increment();
  discarded_microbatches_.Add({{"head", head}}).Increment(static_cast<double>(microbatches));
  discarded_tokens_.Add({{"head", head}}).Increment(static_cast<double>(tokens));
}

void Metrics::HeadWindow(const std::string& head, uint64_t microbatches, uint64_t tokens,
                         absl::Duration age) {
  window_microbatches_.Add({{"head", head}}).Set(static_cast<double>(microbatches));
  window_tokens_.Add({{"head", head}}).Set(static_cast<double>(tokens));
  window_age_.Add({{"head", head}}).Set(Seconds(age));
  // The discard counters exist from the head's first refresh on, at 0: a rate over them (and an
  // alert that compares windows with discards) then sees a value, not a missing series.
  for (auto* family : {&discards_, &discarded_microbatches_, &discarded_tokens_}) {
    family->Add({{"head", head}});
  }
}

void Metrics::RememberedResults(size_t results, size_t bytes,
                                const std::vector<std::pair<std::string, uint64_t>>& evictions) {
  remembered_results_.Add({}).Set(static_cast<double>(results));
  remembered_bytes_.Add({}).Set(static_cast<double>(bytes));
  for (const auto& [cause, count] : evictions) {
    prometheus::Counter& counter = remembered_evictions_.Add({{"cause", cause}});
    const double more = static_cast<double>(count) - counter.Value();
    if (more > 0) counter.Increment(more);
  }
}

void Metrics::ConnectionsOpen(size_t count) {
  connections_open_.Add({}).Set(static_cast<double>(count));
}

void Metrics::ConnectionAccepted() { connections_accepted_.Add({}).Increment(); }

void Metrics::ConnectionRefused() { connections_refused_.Add({}).Increment(); }

void Metrics::ConnectionReaped(absl::string_view reason) {
  connections_reaped_.Add({{"reason", std::string(reason)}}).Increment();
}

void Metrics::RemoveHead(const std::string& head) {
  auto drop = [&head](auto& family, const prometheus::Labels& extra) {
    prometheus::Labels labels = extra;
    labels["head"] = head;
    if (family.Has(labels)) family.Remove(&family.Add(labels));
  };
  for (const char* phase : {"receive", "queue", "stage", "compute", "finish", "send"}) {
    prometheus::Labels labels{{"head", head}, {"phase", phase}};
    if (phase_duration_.Has(labels))
      phase_duration_.Remove(&phase_duration_.Add(labels, Buckets()));
  }
  for (const char* outcome : {"ok", "forward", "replayed", "error"})
    drop(microbatches_, {{"outcome", outcome}});
  for (const auto& [kind, bytes] : HeldKinds(DeviceMemory{})) drop(head_memory_, {{"kind", kind}});
  for (const char* outcome : {"ok", "replayed", "error"})
    drop(optimizer_applies_, {{"outcome", outcome}});
  if (optimizer_apply_duration_.Has({{"head", head}}))
    optimizer_apply_duration_.Remove(&optimizer_apply_duration_.Add({{"head", head}}, Buckets()));
  drop(head_devices_, {});
  drop(tokens_, {});
  drop(pulls_, {});
  drop(pushes_, {});
  for (auto* family : {&discards_, &discarded_microbatches_, &discarded_tokens_}) drop(*family, {});
  for (auto* family : {&window_microbatches_, &window_tokens_, &window_age_}) drop(*family, {});
  // Build, checkpoints and training values.
  for (const char* result : {"ok", "error"}) drop(checkpoint_writes_, {{"result", result}});
  if (checkpoint_duration_.Has({{"head", head}}))
    checkpoint_duration_.Remove(&checkpoint_duration_.Add({{"head", head}}, CheckpointBuckets()));
  drop(checkpoint_bytes_, {});
  drop(checkpoint_last_success_, {});
  drop(weights_version_, {});
  drop(optimizer_step_, {});
  for (const char* outcome : {"ok", "forward"}) drop(last_loss_, {{"outcome", outcome}});
  for (const char* scope : {"head", "total"}) drop(grad_norm_, {{"scope", scope}});
  drop(clip_coefficient_, {});
}

// --- Build, checkpoints and training values. ---

void Metrics::BuildInfo(const std::string& version, const std::string& backend,
                        const std::string& cuda) {
  build_info_.Add({{"version", version}, {"backend", backend}, {"cuda", cuda}}).Set(1);
}

void Metrics::CheckpointInterval(absl::Duration interval) {
  checkpoint_interval_family_.Add({}).Set(Seconds(interval));
}

void Metrics::CheckpointRestoreDuration(absl::Duration duration) {
  checkpoint_restore_family_.Add({}).Set(Seconds(duration));
}

void Metrics::CheckpointWritten(const std::string& head, uint64_t bytes, absl::Duration duration,
                                absl::Time persisted_at) {
  checkpoint_writes_.Add({{"head", head}, {"result", "ok"}}).Increment();
  checkpoint_duration_.Add({{"head", head}}, CheckpointBuckets()).Observe(Seconds(duration));
  CheckpointRestored(head, bytes, persisted_at);
}

void Metrics::CheckpointFailed(const std::string& head, absl::Duration duration) {
  checkpoint_writes_.Add({{"head", head}, {"result", "error"}}).Increment();
  checkpoint_duration_.Add({{"head", head}}, CheckpointBuckets()).Observe(Seconds(duration));
}

void Metrics::CheckpointRestored(const std::string& head, uint64_t bytes, absl::Time persisted_at) {
  checkpoint_bytes_.Add({{"head", head}}).Set(static_cast<double>(bytes));
  checkpoint_last_success_.Add({{"head", head}})
      .Set(absl::ToDoubleSeconds(persisted_at - absl::UnixEpoch()));
}

void Metrics::HeadTraining(const std::string& head, uint64_t weights_version,
                           uint64_t optimizer_step) {
  weights_version_.Add({{"head", head}}).Set(static_cast<double>(weights_version));
  optimizer_step_.Add({{"head", head}}).Set(static_cast<double>(optimizer_step));
}

void Metrics::MicrobatchLoss(const std::string& head, absl::string_view outcome, double loss_sum,
                             int64_t tokens) {
  if (tokens <= 0) return;
  last_loss_.Add({{"head", head}, {"outcome", std::string(outcome)}})
      .Set(loss_sum / static_cast<double>(tokens));
}

void Metrics::OptimizerNorms(const std::string& head, double head_norm, double total_norm,
                             double clip_coefficient) {
  grad_norm_.Add({{"head", head}, {"scope", "head"}}).Set(head_norm);
  grad_norm_.Add({{"head", head}, {"scope", "total"}}).Set(total_norm);
  clip_coefficient_.Add({{"head", head}}).Set(clip_coefficient);
}

}  // namespace losshead::server
