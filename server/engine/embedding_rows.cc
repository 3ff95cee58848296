// Head's tied input embedding: the rows of W for token ids (EmbeddingRows) and the gradient of
// those rows added into the gradient window (an EMBEDDING_GRAD micro-batch of Step). Both work on
// the devices that hold W's rows once (WeightHolders: the one device, replica 0 of a replicated
// head, every shard), each device taking the ids of its own rows, under those devices' compute
// locks: W cannot change under a lookup, and a gradient is counted in the window under the same
// locks that add it to dW, so that a cut sees it wholly before or wholly after. A replicated head
// adds every gradient to replica 0's accumulator, which the cut reduces with the others. A head
// sharded across processes does the same on each process's own rows, its rows exchanged with
// the other processes by embedding_across.cc.
#include "server/engine/embedding_rows.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"
#include "server/engine/host_tensors.h"
#include "server/engine/proto_convert.h"
#include "server/engine/request_fingerprint.h"
#include "server/engine/transfer_buffers.h"

namespace losshead::server {
namespace {

// The positions of `ids` whose rows `replica` holds.
std::vector<int64_t> HeldPositions(const Replica& replica, const std::vector<int64_t>& ids) {
  std::vector<int64_t> positions;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= replica.held.begin && ids[i] < replica.held.end) positions.push_back(i);
  }
  return positions;
}

// A device buffer of `bytes` on `r` (RESOURCE_EXHAUSTED naming `what` when it does not fit).
absl::StatusOr<kernels::DeviceBuffer> AllocateOn(Replica& r, size_t bytes, absl::string_view what) {
  absl::StatusOr<kernels::DeviceBuffer> buffer = r.backend.Allocate(bytes);
  if (!buffer.ok()) return AsResourceExhausted(buffer.status(), what);
  return buffer;
}

}  // namespace

absl::StatusOr<WeightsSnapshot> Head::EmbeddingRows(v1::DType id_dtype, absl::string_view id_bytes,
                                                    v1::DType dtype,
                                                    std::optional<uint64_t> expected_version,
                                                    int origin) {
  if (across_processes() && (origin < 0 || options_.process_window == nullptr)) {
    return absl::InternalError(
        "EmbeddingRows of a head sharded across processes runs through its group's leader");
  }
  kernels::DType to = dtype_;
  if (dtype != v1::DTYPE_UNSPECIFIED) {
    LOSSHEAD_ASSIGN_OR_RETURN(to, FloatDType(dtype, "dtype"));
  }
  LOSSHEAD_ASSIGN_OR_RETURN(const std::vector<int64_t> ids,
                            ParseRowIds(id_dtype, id_bytes, vocab_size()));
  if (ids.empty()) return absl::InvalidArgumentError("EmbeddingRows needs at least one id");
  const int64_t d = hidden_size();
  const size_t row_bytes = static_cast<size_t>(d) * kernels::DTypeSize(dtype_);
  WeightsSnapshot snap;
  snap.dtype = ToProto(to);
  snap.data = TakeTransferBuffer(ids.size() * row_bytes);
  snap.data.resize(ids.size() * row_bytes);
  // Across processes every process reaches the exchange below whatever its devices answer (the
  // checks above and the version decide alike everywhere), so that no peer waits for it.
  absl::Status read;
  {
    // As DownloadWeights: the holders' locks keep pushes and applies (cuts) out.
    const ReplicaGroup::DeviceLocks holders(placement_->WeightHolders());
    {
      absl::MutexLock state(&state_mu_);
      snap.version = version_;
    }
    if (expected_version.has_value() && *expected_version != snap.version) {
      GiveTransferBuffer(std::move(snap.data));
      return absl::FailedPreconditionError(
          absl::StrCat("expected_weights_version is ", *expected_version,
                       " but the head's weights are at version ", snap.version));
    }
    read = ReadHeldRows(ids, row_bytes, snap.data);
  }
  if (across_processes()) {
    const absl::Status gathered = GatherEmbeddingRows(ids, row_bytes, origin, snap.data);
    if (read.ok()) read = gathered;
    if (read.ok() && origin != group().process()) {
      // Only the origin answers its client with the rows.
      GiveTransferBuffer(std::move(snap.data));
      snap.data.clear();
      return snap;
    }
  }
  if (!read.ok()) {
    GiveTransferBuffer(std::move(snap.data));
    return read;
  }
  if (to != dtype_) {
    std::string raw = std::move(snap.data);
    snap.data = ConvertOnHost(dtype_, raw, to);
    GiveTransferBuffer(std::move(raw));
  }
  return snap;
}

absl::Status Head::CheckEmbeddingRows(v1::DType id_dtype, absl::string_view id_bytes,
                                      v1::DType dtype) const {
  if (dtype != v1::DTYPE_UNSPECIFIED) LOSSHEAD_RETURN_IF_ERROR(FloatDType(dtype, "dtype").status());
  LOSSHEAD_ASSIGN_OR_RETURN(const std::vector<int64_t> ids,
                            ParseRowIds(id_dtype, id_bytes, vocab_size()));
  if (ids.empty()) return absl::InvalidArgumentError("EmbeddingRows needs at least one id");
  return absl::OkStatus();
}

absl::Status Head::ReadHeldRows(const std::vector<int64_t>& ids, size_t row_bytes,
                                std::string& rows_out) {
  const int64_t d = hidden_size();
  for (Replica* r : placement_->WeightHolders()) {
    const std::vector<int64_t> positions = HeldPositions(*r, ids);
    if (positions.empty()) continue;
    std::vector<int64_t> local(positions.size());
    for (size_t i = 0; i < positions.size(); ++i) local[i] = ids[positions[i]] - r->held.begin;
    LOSSHEAD_ASSIGN_OR_RETURN(kernels::DeviceBuffer device_ids,
                              AllocateOn(*r, local.size() * sizeof(int64_t), "embedding row ids"));
    LOSSHEAD_ASSIGN_OR_RETURN(kernels::DeviceBuffer rows,
                              AllocateOn(*r, local.size() * row_bytes, "embedding rows"));
    std::string host(local.size() * row_bytes, '\0');
    LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToDevice(device_ids.data(), local.data(),
                                                     local.size() * sizeof(int64_t), *r->stream));
    LOSSHEAD_RETURN_IF_ERROR(r->backend.GatherRows(
        dtype_, r->weights.data(), r->held.size(), d, device_ids.as<int64_t>(),
        static_cast<int64_t>(local.size()), rows.data(), *r->stream));
    LOSSHEAD_RETURN_IF_ERROR(
        r->backend.CopyToHost(host.data(), rows.data(), host.size(), *r->stream));
    LOSSHEAD_RETURN_IF_ERROR(r->stream->Synchronize());
    for (size_t i = 0; i < positions.size(); ++i) {
      std::memcpy(rows_out.data() + positions[i] * row_bytes, host.data() + i * row_bytes,
                  row_bytes);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const StepOutcome>> Head::StepEmbeddingGrad(
    const MicroBatch& mb, StepStats* stats, const std::function<void()>& on_ordered) {
  LOSSHEAD_ASSIGN_OR_RETURN(PreparedEmbeddingGrad p,
                            PrepareEmbeddingGrad(mb, vocab_size(), hidden_size()));
  const std::string& client_id = mb.header.client_id();
  const uint64_t sequence = mb.header.sequence();
  const bool keyed = !client_id.empty();
  if (keyed) {
    const StepFingerprint fingerprint{
        .hidden =
            mb.hidden_digest.has_value() ? *mb.hidden_digest : ByteDigest::Of(mb.hidden_bytes()),
        .targets = mb.targets_digest.has_value() ? *mb.targets_digest : ByteDigest::Of(mb.targets),
        .shape = StepShape(mb.header)};
    LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<const StepOutcome> remembered,
                              cache_.Begin(client_id, sequence, fingerprint));
    if (remembered != nullptr) {
      if (!remembered->failure.ok()) return remembered->failure;
      stats->replayed = true;
      return remembered;
    }
  }
  absl::StatusOr<std::shared_ptr<StepOutcome>> outcome =
      AddEmbeddingGrad(p, mb.header, stats, on_ordered);
  if (!outcome.ok()) {
    if (keyed) cache_.Abandon(client_id, sequence);  // ignored where a failure settled it
    return outcome.status();
  }
  if (keyed) cache_.Complete(client_id, sequence, *outcome);
  {
    absl::MutexLock state(&state_mu_);
    --pending_outcomes_;
  }
  return std::shared_ptr<const StepOutcome>(*std::move(outcome));
}

absl::StatusOr<std::shared_ptr<StepOutcome>> Head::AddEmbeddingGrad(
    const PreparedEmbeddingGrad& p, const v1::StepHeader& header, StepStats* stats,
    const std::function<void()>& on_ordered) {
  const int64_t d = hidden_size();
  std::span<Replica* const> holders = placement_->WeightHolders();
  // Each holder's part (its rows, in its own numbering) on its device before any lock is taken.
  struct Part {
    Replica* replica;
    int64_t count = 0;
    kernels::DeviceBuffer ids;
    kernels::DeviceBuffer values;
    std::vector<int64_t> local;
    std::vector<float> host_values;
  };
  std::vector<Part> parts;
  for (Replica* r : holders) {
    const std::vector<int64_t> positions = HeldPositions(*r, p.ids);
    if (positions.empty()) continue;
    Part part{.replica = r, .count = static_cast<int64_t>(positions.size())};
    part.local.resize(positions.size());
    part.host_values.resize(positions.size() * d);
    // The positions are ascending and p.ids non-decreasing: the part stays sorted.
    for (size_t i = 0; i < positions.size(); ++i) {
      part.local[i] = p.ids[positions[i]] - r->held.begin;
      std::memcpy(part.host_values.data() + i * d, p.values.data() + positions[i] * d,
                  d * sizeof(float));
    }
    LOSSHEAD_ASSIGN_OR_RETURN(
        part.ids, AllocateOn(*r, part.local.size() * sizeof(int64_t), "embedding gradient ids"));
    LOSSHEAD_ASSIGN_OR_RETURN(part.values, AllocateOn(*r, part.host_values.size() * sizeof(float),
                                                      "embedding gradient rows"));
    parts.push_back(std::move(part));
  }
  for (Replica* r : holders) stats->devices.push_back(&r->backend);
  const absl::Time wait_start = absl::Now();
  const ReplicaGroup::DeviceLocks locks(holders);
  if (on_ordered) on_ordered();
  const absl::Time start = absl::Now();
  stats->compute_start = start;
  stats->queue += start - wait_start;
  uint64_t version;
  {
    absl::MutexLock state(&state_mu_);
    version = version_;
    const v1::StepOptions& o = header.options();
    if (o.has_expected_weights_version() && o.expected_weights_version() != version) {
      return absl::FailedPreconditionError(
          absl::StrCat("expected_weights_version is ", o.expected_weights_version(),
                       " but the head's weights are at version ", version));
    }
    LOSSHEAD_RETURN_IF_ERROR(window_.ReserveBound(p.grad_bound()));
  }
  absl::Status ran;
  for (Part& part : parts) {
    Replica& r = *part.replica;
    ran = r.backend.CopyToDevice(part.ids.data(), part.local.data(),
                                 part.local.size() * sizeof(int64_t), *r.stream);
    if (ran.ok()) {
      ran = r.backend.CopyToDevice(part.values.data(), part.host_values.data(),
                                   part.host_values.size() * sizeof(float), *r.stream);
    }
    if (ran.ok()) {
      ran = r.backend.IndexAddRows(part.values.as<float>(), part.ids.as<int64_t>(), part.count, d,
                                   r.grad.as<float>(), r.held.size(), *r.stream);
    }
    if (ran.ok()) ran = r.stream->Synchronize();
    if (!ran.ok()) break;
  }
  if (!ran.ok()) {
    const std::string& client_id = header.client_id();
    absl::Status fault = absl::DataLossError(absl::StrCat(
        "the device failed while adding embedding gradient rows (client '", client_id,
        "', sequence ", header.sequence(), ") to dW: ", ran.message(),
        "; dW may hold part of them, which the gradient window's counters do not count: pull "
        "with reset to drop the window before the next optimizer step",
        client_id.empty() ? "" : "; this key keeps this answer and is never computed again"));
    if (!client_id.empty()) cache_.Fail(client_id, header.sequence(), fault);
    return fault;
  }
  CountRun(0, version);  // a micro-batch of the window without tokens (see StepKind)
  auto outcome = std::make_shared<StepOutcome>();
  outcome->weights_version = version;
  outcome->grad_hidden_dtype = header.hidden_dtype();
  stats->compute_end = absl::Now();
  stats->compute += stats->compute_end - start;
  return outcome;
}

}  // namespace losshead::server
