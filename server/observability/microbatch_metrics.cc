#include "server/observability/microbatch_metrics.h"

namespace losshead::server {
namespace {

// The counters of what a computed micro-batch asked for and ran (MicrobatchRecord).
void RecordAsked(Metrics& metrics, const std::string& head, const MicrobatchRecord& record) {
  if (record.embedding_grad_rows > 0) {
    metrics.EmbeddingGradRows(head, static_cast<uint64_t>(record.embedding_grad_rows));
    return;
  }
  static constexpr std::array<absl::string_view, 4> kOutputs = {"logprob", "entropy", "lse",
                                                                "argmax"};
  for (size_t i = 0; i < kOutputs.size(); ++i) {
    if (record.token_outputs[i]) {
      metrics.TokenOutputTokens(head, kOutputs[i], static_cast<uint64_t>(record.output_tokens));
    }
  }
  if (record.top_k) metrics.TopKMicrobatch(head);
  metrics.LossKindMicrobatch(head, record.policy_gradient ? "policy_gradient" : "cross_entropy");
  if (record.entropy_term) metrics.LossTermMicrobatch(head, "entropy");
  if (record.kl_term) metrics.LossTermMicrobatch(head, "kl");
  if (record.token_weights) metrics.LossTermMicrobatch(head, "token_weights");
}

}  // namespace

void RecordMicrobatch(Metrics& metrics, const std::string& head, const MicrobatchRecord& record,
                      size_t devices, absl::FunctionRef<std::string(size_t)> device_label) {
  using Reach = MicrobatchRecord::Reach;
  const bool ok = record.code == 0;
  if (record.reach == Reach::kRan) {
    metrics.StepPhase(head, "receive", record.receive);
    metrics.StepPhase(head, "queue", record.queue);
    if (ok && !record.replayed) {
      metrics.StepPhase(head, "stage", record.stage);
      metrics.StepPhase(head, "compute", record.compute);
      for (size_t i = 0; i < devices; ++i) {
        const std::string label = device_label(i);
        if (!label.empty()) metrics.DeviceBusy(label, record.compute);
      }
      metrics.StepPhase(head, "finish", record.finish);
    }
    if (!ok) {
      metrics.Microbatch(head, "error", record.code);
    } else if (record.replayed) {
      metrics.Microbatch(head, "replayed");
    } else {
      // Evaluation apart from training: "ok" stays the rate of micro-batches counted in dW.
      const absl::string_view outcome = record.forward_only ? "forward" : "ok";
      metrics.Microbatch(head, outcome);
      metrics.MicrobatchLoss(head, outcome, record.loss_sum, record.tokens);
      metrics.Tokens(head, static_cast<uint64_t>(record.tokens));
      RecordAsked(metrics, head, record);
    }
  } else if (record.reach == Reach::kRefused) {
    metrics.Microbatch(head, "error", record.code);
  } else {
    metrics.Failure("Step", record.code);
  }
  if (ok) metrics.Bytes("Step", "out", record.bytes_out);
}

void RecordMicrobatchSent(Metrics& metrics, const std::string& head, absl::Duration send) {
  metrics.StepPhase(head, "send", send);
}

}  // namespace losshead::server
