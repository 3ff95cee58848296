#include "server/observability/metrics.h"

#include <memory>
#include <string>

#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"
#include "server/observability/metrics_internal.h"

namespace losshead::server {

using metrics_internal::Buckets;
using metrics_internal::CheckpointBuckets;
using metrics_internal::HeldKinds;

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
      token_output_tokens_(prometheus::BuildCounter()
                               .Name("losshead_token_output_tokens_total")
                               .Help("Tokens served with each per-token output asked: logprob, "
                                     "entropy, lse, argmax (replays not counted)")
                               .Register(*registry_)),
      top_k_microbatches_(prometheus::BuildCounter()
                              .Name("losshead_top_k_microbatches_total")
                              .Help("Computed micro-batches that asked for the top-k")
                              .Register(*registry_)),
      loss_kind_microbatches_(prometheus::BuildCounter()
                                  .Name("losshead_loss_microbatches_total")
                                  .Help("Computed loss micro-batches by loss kind: "
                                        "cross_entropy, policy_gradient")
                                  .Register(*registry_)),
      loss_term_microbatches_(prometheus::BuildCounter()
                                  .Name("losshead_loss_term_microbatches_total")
                                  .Help("Computed loss micro-batches by loss term: entropy, kl, "
                                        "token_weights")
                                  .Register(*registry_)),
      embedding_rows_(prometheus::BuildCounter()
                          .Name("losshead_embedding_rows_total")
                          .Help("Rows of W served by EmbeddingRows")
                          .Register(*registry_)),
      embedding_grad_rows_(prometheus::BuildCounter()
                               .Name("losshead_embedding_grad_rows_total")
                               .Help("Embedding-gradient rows added to dW (EMBEDDING_GRAD "
                                     "micro-batches; replays not counted)")
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
      step_data_bytes_(prometheus::BuildCounter()
                           .Name("losshead_step_data_bytes_total")
                           .Help("Step tensor bytes by path (network: in the stream's messages; "
                                 "shared_memory: through a same-node host region; device: "
                                 "through a same-node device region) and direction")
                           .Register(*registry_)),
      shared_memory_regions_(prometheus::BuildGauge()
                                 .Name("losshead_shared_memory_regions")
                                 .Help("Same-node shared memory regions mapped now")
                                 .Register(*registry_)),
      shared_memory_bytes_(prometheus::BuildGauge()
                               .Name("losshead_shared_memory_mapped_bytes")
                               .Help("Bytes of the same-node shared memory regions mapped now")
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
  for (const char* path : {"network", "shared_memory", "device"}) {
    for (const char* direction : {"in", "out"}) {
      step_data_bytes_.Add({{"path", path}, {"direction", direction}});
    }
  }
}

std::string Metrics::RenderText() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
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
  for (const char* output : {"logprob", "entropy", "lse", "argmax"})
    drop(token_output_tokens_, {{"output", output}});
  drop(top_k_microbatches_, {});
  for (const char* kind : {"cross_entropy", "policy_gradient"})
    drop(loss_kind_microbatches_, {{"kind", kind}});
  for (const char* term : {"entropy", "kl", "token_weights"})
    drop(loss_term_microbatches_, {{"term", term}});
  drop(embedding_rows_, {});
  drop(embedding_grad_rows_, {});
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

}  // namespace losshead::server
