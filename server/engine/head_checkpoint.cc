// Head's checkpoint cut: the consistent snapshot, the restore, and client progress. The cut is
// data (head_checkpoint.h); server/durability/ turns it into files.
#include "server/engine/head_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"
#include "server/engine/head_internal.h"
#include "server/engine/process_window.h"
#include "server/engine/proto_convert.h"
#include "server/engine/replica_group.h"

namespace losshead::server {

absl::StatusOr<HeadCheckpointData> Head::Snapshot() {
  if (across_processes()) {
    // Each process holds only its rows: a checkpoint of the whole head is a global cut of every
    // process's parts (SnapshotPart, in a checkpoint set), not one process's snapshot.
    return absl::UnimplementedError(
        "a head sharded across processes cannot be snapshotted (named snapshots); it is "
        "checkpointed in checkpoint sets only");
  }
  return SnapshotPart();
}

absl::StatusOr<HeadCheckpointData> Head::SnapshotPart() {
  HeadCheckpointData d;
  d.spec = spec_;
  // A head sharded across processes: this process's rows [first_row, first_row + rows) only, its
  // shards' in global shard order (contiguous); every other head: all V rows.
  const bool own_rows = across_processes();
  const auto [own_begin, own_end] = head_internal::OwnRowBytes(group(), 1);
  const uint64_t row = static_cast<uint64_t>(hidden_size());
  const uint64_t first_row = own_rows ? own_begin / row : 0;
  const uint64_t rows = own_rows ? (own_end - own_begin) / row : vocab_size();
  if (own_rows) {
    if (options_.process_window == nullptr) {
      return absl::InternalError("a head sharded across processes without its process group");
    }
    d.rows =
        CheckpointRows{.processes = static_cast<uint32_t>(options_.process_window->group()->size()),
                       .process = static_cast<uint32_t>(options_.process_window->group()->rank()),
                       .shards = static_cast<uint32_t>(group().shard_count()),
                       .first_shard = static_cast<uint32_t>(group().first_shard()),
                       .devices = static_cast<uint32_t>(group().size()),
                       .first_row = first_row,
                       .row_count = rows};
  }
  // Where a replica's rows go in the part's tensors (`element_bytes` each).
  auto part_offset = [&](const Replica& r, size_t element_bytes) {
    return head_internal::RowByteOffset(group(), r, element_bytes) -
           static_cast<size_t>(first_row * row) * element_bytes;
  };
  const size_t count = static_cast<size_t>(rows * row);
  const size_t esize = kernels::DTypeSize(dtype_);
  d.weights.resize(count * esize);
  d.gradient.resize(count * sizeof(float));
  // Micro-batches add to dW and bump the counters before their run lands (the Cut waits for that);
  // pulls and pushes hold every lock. Holding them all here makes the snapshot one cut. A
  // micro-batch completes its idempotency claim just after (once its dH is on the host): waiting
  // for those still pending, while no new one can start, puts every micro-batch counted in dW among
  // the remembered ones too.
  ReplicaGroup::Cut cut(group());
  {
    absl::MutexLock state(&state_mu_);
    state_mu_.Await(absl::Condition(
        +[](int* pending) { return *pending == 0; }, &pending_outcomes_));
  }
  Replica& first = group()[0];
  if (own_rows) {
    // A shard holds exactly its rows: each copies them beside the previous shard's.
    for (const auto& r : group().replicas()) {
      LOSSHEAD_RETURN_IF_ERROR(
          r->backend.CopyToHost(d.weights.data() + part_offset(*r, esize), r->weights.data(),
                                head_internal::RowBytes(group(), *r, esize), *r->stream));
    }
  } else {
    LOSSHEAD_RETURN_IF_ERROR(placement_->CopyWeightsOut(d.weights.data()));
  }
  // dW reduced to the owners of its rows, each copying its rows; and the optimizer: each
  // replica's rows of its master copy (even when a push has made it stale: master_version says
  // so and the restored head re-syncs it exactly as this one would) and of its state. The file
  // is the one-device head's whatever the placement.
  LOSSHEAD_RETURN_IF_ERROR(placement_->ReduceGradientToOwners());
  const OptimizerBuffers& optimizer = first.optimizer;
  const bool has_master = optimizer.master.data() != nullptr;
  d.master.resize(has_master ? count * sizeof(float) : 0);
  d.optimizer_state.resize(optimizer.state.size());
  for (std::string& state : d.optimizer_state) state.resize(count * sizeof(float));
  for (const auto& r : group().replicas()) {
    const size_t offset = part_offset(*r, sizeof(float));
    const size_t bytes = head_internal::RowBytes(group(), *r, sizeof(float));
    LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToHost(
        d.gradient.data() + offset,
        r->grad.as<char>() + head_internal::DeviceRowByteOffset(group(), *r, sizeof(float)), bytes,
        *r->stream));
    if (has_master) {
      LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToHost(
          d.master.data() + offset, r->optimizer.master.data(), bytes, *r->stream));
    }
    for (size_t i = 0; i < r->optimizer.state.size(); ++i) {
      LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToHost(
          d.optimizer_state[i].data() + offset, r->optimizer.state[i].data(), bytes, *r->stream));
    }
  }
  LOSSHEAD_RETURN_IF_ERROR(group().Synchronize());
  if (has_bias()) {
    auto bytes = [](const std::vector<float>& v) {
      return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    };
    LOSSHEAD_ASSIGN_OR_RETURN(const std::vector<float> grad_bias, ReadGradBias(group()));
    d.bias = bytes(bias_.values);
    d.grad_bias = bytes(grad_bias);
    for (const std::vector<float>& s : bias_.optimizer_state) {
      d.bias_optimizer_state.push_back(bytes(s));
    }
  }
  *d.spec.mutable_optimizer() = optimizer.spec;
  d.optimizer_step = optimizer.step;
  d.momentum_started = optimizer.momentum_started;
  d.master_version = optimizer.master_version;
  d.applies = applies_.Export();
  {
    absl::MutexLock state(&state_mu_);
    *d.spec.mutable_default_options() = defaults_;
    d.weights_version = version_;
    window_.Export(d);
  }
  d.clients = cache_.Export();
  return d;
}

absl::StatusOr<std::shared_ptr<Head>> Head::Restore(std::span<kernels::Backend* const> devices,
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
  // A part of a head sharded across processes holds this process's rows only: they must be the
  // ones it owns here, in the group it was written in (checked before the collective's creation,
  // which every process of the group joins).
  const std::optional<CheckpointRows>& part = data.rows;
  if (part.has_value() != data.spec.placement().across_processes()) {
    return absl::DataLossError(
        "checkpoint's rows record does not match its placement (across_processes)");
  }
  std::shared_ptr<kernels::ProcessGroup> processes;
  if (part.has_value()) {
    if (options.process_window == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint holds rows ", part->first_row, " to ", part->first_row + part->row_count,
          " of a head sharded across ", part->processes,
          " processes: it is restored only in a group of that size, from its checkpoint set"));
    }
    processes = options.process_window->group();
    LOSSHEAD_RETURN_IF_ERROR(CheckPartRows(*part, data.spec, processes->size(), processes->rank(),
                                           static_cast<int>(devices.size())));
  }
  const uint64_t first_row = part.has_value() ? part->first_row : 0;
  const uint64_t rows = part.has_value() ? part->row_count : v;
  const uint64_t count = rows * d;
  if (data.weights.size() != count * kernels::DTypeSize(dtype) ||
      data.gradient.size() != count * sizeof(float)) {
    return absl::DataLossError(absl::StrCat("checkpoint of ", rows, " rows of a ", v, " x ", d, " ",
                                            kernels::DTypeName(dtype), " head holds ",
                                            data.weights.size(), " weight bytes and ",
                                            data.gradient.size(), " gradient bytes"));
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
  // An output bias: b and db of V, and b's state as W's (none without a bias).
  const size_t bias_bytes = data.spec.bias() ? v * sizeof(float) : 0;
  bool bias_fits = data.bias.size() == bias_bytes && data.grad_bias.size() == bias_bytes &&
                   data.bias_optimizer_state.size() == (data.spec.bias() ? buffers : 0);
  for (const std::string& state : data.bias_optimizer_state) {
    bias_fits = bias_fits && state.size() == bias_bytes;
  }
  if (!bias_fits) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint of a ", v, " x ", d, " head ", data.spec.bias() ? "with" : "without",
        " an output bias holds ", data.bias.size(), " bias bytes, ", data.grad_bias.size(),
        " bias gradient bytes and ", data.bias_optimizer_state.size(),
        " bias optimizer state buffers"));
  }
  auto floats = [](const std::string& bytes) {
    std::vector<float> out(bytes.size() / sizeof(float));
    std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
    return out;
  };
  if (data.spec.bias() && kernels::HasNonFinite(kernels::DType::kFP32, data.bias.data(), v)) {
    return absl::DataLossError("checkpoint holds an output bias with NaN or Inf");
  }
  if (data.master.size() != footprint.master || !state_fits) {
    return absl::DataLossError(
        absl::StrCat("checkpoint of ", rows, " rows of a ", v, " x ", d, " head holds ",
                     data.master.size(), " master weight bytes and ", data.optimizer_state.size(),
                     " optimizer state buffers that do not fit its optimizer"));
  }
  // The file is the same for every placement: the head goes on `devices` (the registry's
  // answer to the saved placement, on this server) and keeps the placement it was asked for.
  v1::HeadSpec placed = data.spec;
  *placed.mutable_placement() =
      PlacementOn(data.spec.placement(), static_cast<int>(devices.size()));
  LOSSHEAD_ASSIGN_OR_RETURN(std::unique_ptr<Placement> placement,
                            Placement::Create(devices, placed, dtype, processes));
  if (part.has_value()) {
    // The global shards the collective gave this process: those the part was written from, or
    // another process of the group runs on another device count now.
    const ReplicaGroup& shards = placement->group();
    if (static_cast<uint32_t>(shards.shard_count()) != part->shards ||
        static_cast<uint32_t>(shards.first_shard()) != part->first_shard) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint holds the rows of shards ", part->first_shard, " to ",
          part->first_shard + part->devices, " of ", part->shards, " but this process now holds ",
          "shards ", shards.first_shard(), " to ", shards.first_shard() + shards.size(), " of ",
          shards.shard_count(), " (another process of the group has another device count)"));
    }
  }
  std::shared_ptr<Head> head(new Head(std::move(placement), data.spec, dtype, options));
  LOSSHEAD_RETURN_IF_ERROR(head->Initialize(options.workspace_budget_bytes, false));
  LOSSHEAD_ASSIGN_OR_RETURN(std::vector<OptimizerBuffers> optimizers,
                            head->AllocateOptimizers(data.spec.optimizer()));
  {
    Placement& placement = *head->placement_;
    ReplicaGroup& group = placement.group();
    ReplicaGroup::Cut cut(group);
    // W to replica 0 and from there to the others; the whole dW to replica 0 (the others' are
    // zero, so the sum is the saved window); each replica's rows of the optimizer. A shard takes
    // its rows of each.
    // A part: its rows, from their element offset in W.
    const int64_t first = static_cast<int64_t>(first_row * d);
    const int64_t count = static_cast<int64_t>(rows * d);
    LOSSHEAD_RETURN_IF_ERROR(placement.CopyIn(&Replica::weights, kernels::DTypeSize(dtype),
                                              data.weights.data(), first, count));
    LOSSHEAD_RETURN_IF_ERROR(
        placement.CopyIn(&Replica::grad, sizeof(float), data.gradient.data(), first, count));
    LOSSHEAD_RETURN_IF_ERROR(placement.BroadcastWeights());
    for (const auto& r : group.replicas()) {
      OptimizerBuffers& optimizer = optimizers[r->rank];
      const size_t offset = head_internal::RowByteOffset(group, *r, sizeof(float)) -
                            static_cast<size_t>(first_row * d) * sizeof(float);
      const size_t bytes = head_internal::RowBytes(group, *r, sizeof(float));
      if (!data.master.empty()) {
        LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToDevice(
            optimizer.master.data(), data.master.data() + offset, bytes, *r->stream));
      }
      for (size_t i = 0; i < buffers; ++i) {
        LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToDevice(
            optimizer.state[i].data(), data.optimizer_state[i].data() + offset, bytes, *r->stream));
      }
      optimizer.step = data.optimizer_step;
      optimizer.momentum_started = data.momentum_started;
      optimizer.master_version = data.master_version;
      r->optimizer = std::move(optimizer);
    }
    head->applies_.Import(data.applies);
    LOSSHEAD_RETURN_IF_ERROR(group.Synchronize());
    if (data.spec.bias()) {
      head->bias_.values = floats(data.bias);
      for (const std::string& state : data.bias_optimizer_state) {
        head->bias_.optimizer_state.push_back(floats(state));
      }
      LOSSHEAD_RETURN_IF_ERROR(CopyBiasIn(group, head->bias_.values));
      LOSSHEAD_RETURN_IF_ERROR(RestoreGradBias(group, floats(data.grad_bias)));
    }
    // The bounds the next micro-batches are checked against, over the whole of W and dW: across
    // processes the largest of every process's rows, so that every process decides alike.
    float weight_abs = kernels::MaxAbs(dtype, data.weights.data(), count);
    float grad_abs = kernels::MaxAbs(kernels::DType::kFP32, data.gradient.data(), count);
    if (part.has_value()) {
      LOSSHEAD_ASSIGN_OR_RETURN(
          const std::vector<double> every,
          head->GatherDoubles("the restored bounds of W and dW", {weight_abs, grad_abs}));
      for (size_t i = 0; i + 1 < every.size(); i += 2) {
        weight_abs = std::max(weight_abs, static_cast<float>(every[i]));
        grad_abs = std::max(grad_abs, static_cast<float>(every[i + 1]));
      }
    }
    absl::MutexLock state(&head->state_mu_);
    head->version_ = data.weights_version;
    head->weight_abs_ = weight_abs;
    // The window's age counts from the restore: when it opened is not in the file.
    head->window_.Import(data, grad_abs);
    head->optimizer_spec_ = data.spec.optimizer();
    head->optimizer_step_ = data.optimizer_step;
    head->optimizer_footprint_ = footprint;
  }
  head->cache_.Import(data.clients);
  head->MarkPersisted(data);  // what was restored is, by definition, persisted
  return head;
}

absl::Status CheckPartRows(const CheckpointRows& rows, const v1::HeadSpec& spec, int processes,
                           int process, int devices) {
  if (rows.processes != static_cast<uint32_t>(processes) ||
      rows.process != static_cast<uint32_t>(process) ||
      rows.devices != static_cast<uint32_t>(devices)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the part of head '", spec.name(), "' was written by process ", rows.process, " of ",
        rows.processes, " holding ", rows.devices, " devices' shards; this is process ", process,
        " of ", processes, " with ", devices,
        ": a head sharded across processes is restored "
        "only in the group size, rank and device count that wrote it"));
  }
  // The rows its shards own: shards first_shard to first_shard + devices of `shards` (none when
  // those do not exist).
  const int64_t v = static_cast<int64_t>(spec.vocab_size());
  const uint64_t last = rows.first_shard + uint64_t{rows.devices};
  uint64_t begin = 0, end = 0;
  if (rows.devices > 0 && last <= rows.shards) {
    begin = kernels::ShardRange(v, static_cast<int>(rows.shards), rows.first_shard).begin;
    end = kernels::ShardRange(v, static_cast<int>(rows.shards), static_cast<int>(last - 1)).end;
  }
  if (end == begin || rows.first_row != begin || rows.row_count != end - begin) {
    return absl::DataLossError(absl::StrCat(
        "the part of head '", spec.name(), "' holds rows ", rows.first_row, " to ",
        rows.first_row + rows.row_count, " but shards ", rows.first_shard, " to ", last, " of ",
        rows.shards, " of its ", v, " rows own rows ", begin, " to ", end));
  }
  return absl::OkStatus();
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
