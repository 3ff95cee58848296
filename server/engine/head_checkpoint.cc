// Head's checkpoint cut: the consistent snapshot, the restore, and client progress. The cut is
// data (head_checkpoint.h); server/durability/ turns it into files.
#include "server/engine/head_checkpoint.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/engine/head.h"
#include "server/engine/proto_convert.h"
#include "server/engine/status_macros.h"

namespace losshead::server {

absl::StatusOr<HeadCheckpointData> Head::Snapshot() {
  HeadCheckpointData d;
  d.spec = spec_;
  d.weights.resize(weights_.bytes());
  d.gradient.resize(grad_.bytes());
  // Micro-batches add to dW and bump the counters under compute_mu_; pulls and pushes hold it too.
  // Holding it here makes the snapshot one cut. A micro-batch completes its idempotency claim just
  // after (once its dH is on the host): waiting for those still pending, while no new one can
  // start, puts every micro-batch counted in dW among the remembered ones too.
  absl::MutexLock lock(&compute_mu_);
  {
    absl::MutexLock state(&state_mu_);
    state_mu_.Await(absl::Condition(
        +[](int* pending) { return *pending == 0; }, &pending_outcomes_));
  }
  LOSSHEAD_RETURN_IF_ERROR(
      backend_.CopyToHost(d.weights.data(), weights_.data(), weights_.bytes(), *stream_));
  LOSSHEAD_RETURN_IF_ERROR(
      backend_.CopyToHost(d.gradient.data(), grad_.data(), grad_.bytes(), *stream_));
  // The optimizer: its master copy (even when a push has made it stale: master_version says so
  // and the restored head re-syncs it exactly as this one would) and its state.
  d.master.resize(optimizer_.master.bytes());
  LOSSHEAD_RETURN_IF_ERROR(
      backend_.CopyToHost(d.master.data(), optimizer_.master.data(), d.master.size(), *stream_));
  d.optimizer_state.resize(optimizer_.state.size());
  for (size_t i = 0; i < optimizer_.state.size(); ++i) {
    d.optimizer_state[i].resize(optimizer_.state[i].bytes());
    LOSSHEAD_RETURN_IF_ERROR(backend_.CopyToHost(d.optimizer_state[i].data(),
                                                 optimizer_.state[i].data(),
                                                 d.optimizer_state[i].size(), *stream_));
  }
  LOSSHEAD_RETURN_IF_ERROR(stream_->Synchronize());
  *d.spec.mutable_optimizer() = optimizer_.spec;
  d.optimizer_step = optimizer_.step;
  d.momentum_started = optimizer_.momentum_started;
  d.master_version = optimizer_.master_version;
  d.applies = applies_.Export();
  {
    absl::MutexLock state(&state_mu_);
    *d.spec.mutable_default_options() = defaults_;
    d.weights_version = version_;
    d.tokens_since_pull = tokens_since_pull_;
    d.microbatches_since_pull = microbatches_since_pull_;
    d.min_version_since_pull = min_version_since_pull_;
    d.max_version_since_pull = max_version_since_pull_;
    d.tokens_total = tokens_total_;
    d.microbatches_total = microbatches_total_;
  }
  d.clients = cache_.Export();
  return d;
}

absl::StatusOr<std::shared_ptr<Head>> Head::Restore(kernels::Backend& backend,
                                                    const HeadCheckpointData& data,
                                                    const HeadOptions& options) {
  if (absl::Status s = ValidateSpec(data.spec); !s.ok()) {
    return absl::DataLossError(absl::StrCat("checkpoint holds an invalid spec: ", s.message()));
  }
  const kernels::DType dtype = *FloatDType(data.spec.weight_dtype(), "weight_dtype");
  const uint64_t v = data.spec.vocab_size();
  const uint64_t d = data.spec.hidden_size();
  if (d > (uint64_t{1} << 60) / (4 * v)) {
    return absl::DataLossError(absl::StrCat("checkpoint holds a ", v, " x ", d, " head"));
  }
  const uint64_t count = v * d;
  if (data.weights.size() != count * kernels::DTypeSize(dtype) ||
      data.gradient.size() != count * sizeof(float)) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint of a ", v, " x ", d, " ", kernels::DTypeName(dtype), " head holds ",
        data.weights.size(), " weight bytes and ", data.gradient.size(), " gradient bytes"));
  }
  if (data.weights_version < 1) {
    return absl::DataLossError("checkpoint holds weights version 0");
  }
  const OptimizerFootprint footprint = OptimizerBytes(data.spec.optimizer(), dtype, count);
  const size_t buffers = StateBufferCount(data.spec.optimizer());
  bool state_fits = data.optimizer_state.size() == buffers;
  for (const std::string& state : data.optimizer_state) {
    state_fits = state_fits && state.size() == count * sizeof(float);
  }
  if (data.master.size() != footprint.master || !state_fits) {
    return absl::DataLossError(
        absl::StrCat("checkpoint of a ", v, " x ", d, " head holds ", data.master.size(),
                     " master weight bytes and ", data.optimizer_state.size(),
                     " optimizer state buffers that do not fit its optimizer"));
  }
  std::shared_ptr<Head> head(new Head(backend, data.spec, dtype, options));
  LOSSHEAD_RETURN_IF_ERROR(head->Initialize(options.workspace_budget_bytes, false));
  LOSSHEAD_ASSIGN_OR_RETURN(OptimizerBuffers optimizer,
                            AllocateOptimizer(backend, data.spec.optimizer(), dtype, count));
  {
    absl::MutexLock lock(&head->compute_mu_);
    LOSSHEAD_RETURN_IF_ERROR(backend.CopyToDevice(optimizer.master.data(), data.master.data(),
                                                  data.master.size(), *head->stream_));
    for (size_t i = 0; i < buffers; ++i) {
      LOSSHEAD_RETURN_IF_ERROR(
          backend.CopyToDevice(optimizer.state[i].data(), data.optimizer_state[i].data(),
                               data.optimizer_state[i].size(), *head->stream_));
    }
    optimizer.step = data.optimizer_step;
    optimizer.momentum_started = data.momentum_started;
    optimizer.master_version = data.master_version;
    head->optimizer_ = std::move(optimizer);
    head->applies_.Import(data.applies);
    LOSSHEAD_RETURN_IF_ERROR(backend.CopyToDevice(head->weights_.data(), data.weights.data(),
                                                  data.weights.size(), *head->stream_));
    LOSSHEAD_RETURN_IF_ERROR(backend.CopyToDevice(head->grad_.data(), data.gradient.data(),
                                                  data.gradient.size(), *head->stream_));
    LOSSHEAD_RETURN_IF_ERROR(head->stream_->Synchronize());
    absl::MutexLock state(&head->state_mu_);
    head->version_ = data.weights_version;
    head->tokens_since_pull_ = data.tokens_since_pull;
    head->microbatches_since_pull_ = data.microbatches_since_pull;
    head->min_version_since_pull_ = data.min_version_since_pull;
    head->max_version_since_pull_ = data.max_version_since_pull;
    head->tokens_total_ = data.tokens_total;
    head->microbatches_total_ = data.microbatches_total;
    head->optimizer_spec_ = data.spec.optimizer();
    head->optimizer_step_ = data.optimizer_step;
    head->optimizer_footprint_ = footprint;
  }
  head->cache_.Import(data.clients);
  head->MarkPersisted(data);  // what was restored is, by definition, persisted
  return head;
}

void Head::MarkPersisted(const HeadCheckpointData& data) {
  absl::MutexLock lock(&persisted_mu_);
  for (const ClientCheckpoint& c : data.clients) {
    if (!c.max_applied.has_value()) continue;
    uint64_t& persisted = persisted_[c.client_id];
    persisted = std::max(persisted, *c.max_applied);
  }
}

v1::ClientProgress Head::Progress(const std::string& client_id) const {
  v1::ClientProgress p;
  p.set_client_id(client_id);
  if (std::optional<uint64_t> applied = cache_.max_applied(client_id)) {
    p.set_acknowledged_sequence(*applied);
  }
  absl::MutexLock lock(&persisted_mu_);
  if (auto it = persisted_.find(client_id); it != persisted_.end()) {
    p.set_persisted_sequence(it->second);
  }
  return p;
}

}  // namespace losshead::server
