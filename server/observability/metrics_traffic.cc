// Metrics of what the server serves: RPCs, micro-batches and their phases, bytes, transfers,
// optimizer applies, device busy time and client connections.
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "server/observability/metrics.h"
#include "server/observability/metrics_internal.h"

namespace losshead::server {
namespace {

using metrics_internal::Buckets;
using metrics_internal::Seconds;

// "ok", "invalid_argument", ...: the value of losshead_rpcs_total{code} and of
// losshead_failures_total{reason}, one spelling for both so that they join and compare as they
// are (absl and gRPC share the numeric codes).
std::string CodeName(int code) {
  return absl::AsciiStrToLower(absl::StatusCodeToString(static_cast<absl::StatusCode>(code)));
}
std::string ReasonName(int code) { return CodeName(code); }

}  // namespace

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

void Metrics::TokenOutputTokens(const std::string& head, absl::string_view output,
                                uint64_t tokens) {
  token_output_tokens_.Add({{"head", head}, {"output", std::string(output)}})
      .Increment(static_cast<double>(tokens));
}

void Metrics::TopKMicrobatch(const std::string& head) {
  top_k_microbatches_.Add({{"head", head}}).Increment();
}

void Metrics::LossKindMicrobatch(const std::string& head, absl::string_view kind) {
  loss_kind_microbatches_.Add({{"head", head}, {"kind", std::string(kind)}}).Increment();
}

void Metrics::LossTermMicrobatch(const std::string& head, absl::string_view term) {
  loss_term_microbatches_.Add({{"head", head}, {"term", std::string(term)}}).Increment();
}

void Metrics::EmbeddingRowsServed(const std::string& head, uint64_t rows) {
  embedding_rows_.Add({{"head", head}}).Increment(static_cast<double>(rows));
}

void Metrics::EmbeddingGradRows(const std::string& head, uint64_t rows) {
  embedding_grad_rows_.Add({{"head", head}}).Increment(static_cast<double>(rows));
}

void Metrics::Bytes(absl::string_view method, absl::string_view direction, uint64_t bytes) {
  bytes_.Add({{"method", std::string(method)}, {"direction", std::string(direction)}})
      .Increment(static_cast<double>(bytes));
}

void Metrics::StepDataBytes(absl::string_view path, absl::string_view direction, uint64_t bytes) {
  step_data_bytes_.Add({{"path", std::string(path)}, {"direction", std::string(direction)}})
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

void Metrics::DeviceBusy(const std::string& device, absl::Duration duration) {
  device_busy_.Add({{"device", device}}).Increment(Seconds(duration));
}

void Metrics::ConnectionsOpen(size_t count) {
  connections_open_.Add({}).Set(static_cast<double>(count));
}

void Metrics::ConnectionAccepted() { connections_accepted_.Add({}).Increment(); }

void Metrics::ConnectionRefused() { connections_refused_.Add({}).Increment(); }

void Metrics::ConnectionReaped(absl::string_view reason) {
  connections_reaped_.Add({{"reason", std::string(reason)}}).Increment();
}

}  // namespace losshead::server
