// Metrics of what the server holds and how training goes: memory, devices, heads, tokens in force,
// gradient windows, remembered results, the build, checkpoints and training values.
#include <string>
#include <utility>
#include <vector>

#include "server/observability/metrics.h"
#include "server/observability/metrics_internal.h"

namespace losshead::server {

using metrics_internal::CheckpointBuckets;
using metrics_internal::HeldKinds;
using metrics_internal::Seconds;

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

void Metrics::HostBufferBytes(size_t page_locked_held, size_t page_locked_idle, size_t dh_idle) {
  host_buffers_.Add({{"pool", "page_locked"}, {"state", "held"}})
      .Set(static_cast<double>(page_locked_held));
  host_buffers_.Add({{"pool", "page_locked"}, {"state", "idle"}})
      .Set(static_cast<double>(page_locked_idle));
  host_buffers_.Add({{"pool", "dh"}, {"state", "idle"}}).Set(static_cast<double>(dh_idle));
}

void Metrics::SharedMemoryMapped(size_t regions, size_t bytes) {
  shared_memory_regions_.Add({}).Set(static_cast<double>(regions));
  shared_memory_bytes_.Add({}).Set(static_cast<double>(bytes));
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
