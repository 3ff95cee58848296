// The head itself: creation (spec validation, placement, allocation, initial W), info, default
// options and its devices' memory. The step pipeline, the gradient window, the optimizer and the
// checkpoint cut are in step_pipeline.cc, gradient_window.cc, optimizer_apply.cc and
// head_checkpoint.cc.
#include "server/engine/head.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head_internal.h"
#include "server/engine/head_registry.h"
#include "server/engine/process_window.h"
#include "server/engine/proto_convert.h"
#include "server/engine/weight_init.h"

namespace losshead::server {

namespace {

// Idle dH buffers a head given no shared pool keeps for reuse: a few full-size (8192 x 4096 bf16)
// results.
constexpr size_t kIdleResultBytes = size_t{256} << 20;

constexpr uint32_t kMaxPlacementDevices = 1 << 16;

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  for (char c : name) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// Where a micro-batch of `head` lacks device memory: the other heads' idle stashes (none without
// lenders).
DeviceScratch::TakeBack TakeBackFrom(const std::shared_ptr<StashLenders>& lenders,
                                     const Head* head) {
  if (lenders == nullptr) return nullptr;
  return [lenders, head](kernels::Backend& device, size_t bytes) {
    return lenders->TakeBack(device, head, bytes);
  };
}

}  // namespace

absl::Status Head::ValidateName(const std::string& name) {
  if (!ValidName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head name must match [A-Za-z0-9_.-]{1,128}, got '", name.substr(0, 160), "'"));
  }
  return absl::OkStatus();
}

absl::Status Head::ValidateSpec(const v1::HeadSpec& spec) {
  LOSSHEAD_RETURN_IF_ERROR(ValidateName(spec.name()));
  if (spec.vocab_size() < 1 || spec.vocab_size() > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size must be in [1, 2^31), got ", spec.vocab_size()));
  }
  if (spec.hidden_size() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_size must be >= 1, got ", spec.hidden_size()));
  }
  const absl::StatusOr<kernels::DType> dtype = FloatDType(spec.weight_dtype(), "weight_dtype");
  if (!dtype.ok()) return dtype.status();
  if (absl::Status s = ToKernel(spec.matmul_precision(), *dtype).status(); !s.ok()) return s;
  if (spec.init().has_normal()) {
    const float std = spec.init().normal().std();
    if (!(std > 0.0f) || !std::isfinite(std)) {
      return absl::InvalidArgumentError(
          absl::StrCat("init.normal.std must be finite and > 0, got ", std));
    }
  }
  LOSSHEAD_RETURN_IF_ERROR(ValidateOptimizerSpec(spec.optimizer()));
  LOSSHEAD_RETURN_IF_ERROR(ValidatePlacement(spec.placement()));
  return ValidateLossOptions(spec.default_options());
}

absl::Status Head::ValidatePlacement(const v1::Placement& placement) {
  switch (placement.kind()) {
    case v1::PLACEMENT_UNSPECIFIED:
    case v1::PLACEMENT_SINGLE:
      if (placement.across_processes()) {
        return absl::InvalidArgumentError(
            "placement.across_processes is for PLACEMENT_SHARDED only");
      }
      if (placement.devices() > 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "placement.devices must be 0 or 1 for a one-device head, got ", placement.devices(),
            " (PLACEMENT_REPLICATED or PLACEMENT_SHARDED spread a head over several)"));
      }
      return absl::OkStatus();
    case v1::PLACEMENT_REPLICATED:
    case v1::PLACEMENT_SHARDED:
      if (placement.across_processes() && placement.kind() != v1::PLACEMENT_SHARDED) {
        return absl::InvalidArgumentError(
            "placement.across_processes is for PLACEMENT_SHARDED only (a replicated head is "
            "replicated across the processes of a group as it is)");
      }
      // Far beyond any server's devices, and within int: PlacementDevices counts in int.
      if (placement.devices() > kMaxPlacementDevices) {
        return absl::InvalidArgumentError(absl::StrCat("placement.devices must be at most ",
                                                       kMaxPlacementDevices, ", got ",
                                                       placement.devices()));
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("placement.kind must be PLACEMENT_SINGLE, PLACEMENT_REPLICATED or "
                       "PLACEMENT_SHARDED, got ",
                       static_cast<int>(placement.kind())));
  }
}

Head::Head(std::unique_ptr<Placement> placement, const v1::HeadSpec& spec, kernels::DType dtype,
           const HeadOptions& options)
    : placement_(std::move(placement)),
      spec_(spec),
      dtype_(dtype),
      options_(options),
      scratch_(spec.name(), TakeBackFrom(options.stash_lenders, this), options.grad_stash_bytes,
               placement_->group()),
      results_(options.results != nullptr ? options.results
                                          : std::make_shared<ResultPool>(kIdleResultBytes)),
      cache_(options.idempotency_window, options.idempotency_max_bytes_per_client,
             options.idempotency_budget),
      applies_(options.apply_window) {
  absl::MutexLock lock(&state_mu_);
  defaults_ = spec.default_options();
  if (options_.grad_stash_bytes > 0 && options_.grad_stash_idle != absl::InfiniteDuration()) {
    group().StartIdleFlush(options_.grad_stash_idle);
  }
}

Head::~Head() {
  const std::vector<kernels::Backend*> freed = devices();
  placement_.reset();  // each replica waits for its stream's work before freeing its buffers
  if (options_.stash_lenders != nullptr) options_.stash_lenders->Freed(freed);
}

std::vector<kernels::Backend*> Head::devices() const {
  std::vector<kernels::Backend*> out;
  for (const auto& r : group().replicas()) out.push_back(&r->backend);
  return out;
}

std::vector<Head::DeviceFootprint> Head::Footprint(const v1::HeadSpec& spec, int k) {
  const kernels::DType dtype = *FloatDType(spec.weight_dtype(), "weight_dtype");
  const uint64_t v = spec.vocab_size();
  const uint64_t d = spec.hidden_size();
  std::vector<DeviceFootprint> out;
  for (int r = 0; r < k; ++r) {
    // Each device owns its rows of the optimizer (ZeRO-1); a replica holds all of W and dW.
    const uint64_t rows = kernels::ShardRange(static_cast<int64_t>(v), k, r).size();
    const uint64_t held = HeldRows(spec.placement(), static_cast<int64_t>(v), k, r);
    // An output bias: b and its db over the held rows, fp32.
    const uint64_t bias = spec.bias() ? held * 2 * sizeof(float) : 0;
    out.push_back({.tensors = held * d * (kernels::DTypeSize(dtype) + sizeof(float)) + bias,
                   .optimizer = OptimizerBytes(spec.optimizer(), dtype, rows * d).total()});
  }
  return out;
}

absl::StatusOr<std::shared_ptr<Head>> Head::Create(std::span<kernels::Backend* const> devices,
                                                   const v1::HeadSpec& spec,
                                                   const HeadOptions& options) {
  LOSSHEAD_RETURN_IF_ERROR(ValidateSpec(spec));
  const kernels::DType dtype = *FloatDType(spec.weight_dtype(), "weight_dtype");
  const uint64_t v = spec.vocab_size();
  const uint64_t d = spec.hidden_size();
  // The fp32 accumulator is the largest tensor; refuse sizes whose byte count would overflow.
  if (d > (uint64_t{1} << 60) / (4 * v)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a ", v, " x ", d, " head is too large to allocate"));
  }
  LOSSHEAD_ASSIGN_OR_RETURN(
      std::unique_ptr<Placement> placement,
      Placement::Create(
          devices, spec, dtype,
          options.process_window != nullptr ? options.process_window->group() : nullptr));
  // Admission: refuse a head whose tensors cannot all fit before allocating any of them (an
  // optimizer's state is several times W). A backend that cannot tell (total 0) is not checked.
  // Across processes, each of this process's shards is its global one.
  const ReplicaGroup& placed = placement->group();
  const std::vector<DeviceFootprint> footprint = Footprint(spec, placed.shard_count());
  for (const auto& replica : placed.replicas()) {
    const DeviceFootprint& needed = footprint[placed.first_shard() + replica->rank];
    const kernels::MemoryInfo memory = replica->backend.memory_info();
    if (memory.total_bytes > 0 && needed.total() > memory.free_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("a ", v, " x ", d, " head needs ", needed.total(), " bytes on ",
                       replica->backend.device_description(), " (W, dW and the optimizer's ",
                       needed.optimizer, ") but the device has ", memory.free_bytes, " free"));
    }
  }
  std::shared_ptr<Head> head(new Head(std::move(placement), spec, dtype, options));
  LOSSHEAD_RETURN_IF_ERROR(head->Initialize(options.workspace_budget_bytes, true));
  if (HasOptimizer(spec.optimizer())) {
    LOSSHEAD_ASSIGN_OR_RETURN(std::vector<OptimizerBuffers> buffers,
                              head->AllocateOptimizers(spec.optimizer()));
    ReplicaGroup::Cut cut(head->group());
    LOSSHEAD_RETURN_IF_ERROR(head->InstallOptimizer(std::move(buffers)));
  }
  return head;
}

absl::Status Head::Initialize(size_t workspace_budget, bool init_weights) {
  ReplicaGroup::Cut cut(group());
  const size_t count = static_cast<size_t>(vocab_size()) * hidden_size();
  const size_t esize = kernels::DTypeSize(dtype_);
  for (const auto& r : group().replicas()) {
    const size_t held = static_cast<size_t>(ReplicaGroup::DeviceRows(*r)) * hidden_size();
    auto w = r->backend.Allocate(held * esize);
    if (!w.ok()) return AsResourceExhausted(w.status(), "weights");
    r->weights = std::move(*w);
    auto g = r->backend.Allocate(held * sizeof(float));
    if (!g.ok()) return AsResourceExhausted(g.status(), "the gradient accumulator");
    r->grad = std::move(*g);
    LOSSHEAD_ASSIGN_OR_RETURN(r->stream, r->backend.CreateStream());
    // The workspace itself is allocated on first use, sized for the micro-batch; here we only
    // make sure some chunk size fits the budget so that a head that could never step is refused
    // now.
    LOSSHEAD_RETURN_IF_ERROR(placement_->CheckWorkspace(*r, workspace_budget));
    LOSSHEAD_RETURN_IF_ERROR(r->backend.Memset(r->grad.data(), 0, r->grad.bytes(), *r->stream));
  }
  if (has_bias()) {
    // b starts at zero (a restore overwrites it), db with the window.
    LOSSHEAD_RETURN_IF_ERROR(AllocateBias(group()));
    bias_.values.assign(static_cast<size_t>(vocab_size()), 0.0f);
    LOSSHEAD_RETURN_IF_ERROR(CopyBiasIn(group(), bias_.values));
  }
  if (!init_weights) return group().Synchronize();  // a restore overwrites W
  if (!spec_.init().has_normal()) {
    for (const auto& r : group().replicas()) {
      LOSSHEAD_RETURN_IF_ERROR(
          r->backend.Memset(r->weights.data(), 0, r->weights.bytes(), *r->stream));
    }
    return group().Synchronize();
  } else {
    // Whole init blocks, a few per thread, drawn together and then copied in.
    const int threads = NormalInitThreads();
    const size_t piece = static_cast<size_t>(kNormalInitBlock) * 2 * threads;
    std::string drawn(std::min(count, piece) * esize, '\0');
    float drawn_abs = 0;  // bounds the micro-batches (ReserveStepBounds); a zero W is 0
    for (size_t i = 0; i < count; i += piece) {
      const size_t n = std::min(piece, count - i);
      if (!DrawNormalInit(spec_.init().normal(), dtype_, static_cast<int64_t>(i),
                          static_cast<int64_t>(n), threads, drawn.data())) {
        return absl::InvalidArgumentError(
            absl::StrCat("init.normal.std ", spec_.init().normal().std(),
                         " draws values that overflow the head's dtype ",
                         kernels::DTypeName(dtype_), "; give a smaller std"));
      }
      drawn_abs = std::max(drawn_abs, kernels::MaxAbs(dtype_, drawn.data(), n));
      LOSSHEAD_RETURN_IF_ERROR(placement_->CopyIn(&Replica::weights, esize, drawn.data(),
                                                  static_cast<int64_t>(i),
                                                  static_cast<int64_t>(n)));
      // The host piece is reused for the next one: the copy must have landed.
      LOSSHEAD_RETURN_IF_ERROR(group().Synchronize());
    }
    absl::MutexLock state(&state_mu_);
    weight_abs_ = drawn_abs;
  }
  LOSSHEAD_RETURN_IF_ERROR(placement_->BroadcastWeights());
  return group().Synchronize();
}

absl::Status Head::SetDefaultOptions(const v1::LossOptions& options) {
  LOSSHEAD_RETURN_IF_ERROR(ValidateLossOptions(options));
  absl::MutexLock state(&state_mu_);
  defaults_ = options;
  return absl::OkStatus();
}

size_t Head::weights_bytes() const {
  size_t bytes = 0;
  for (const auto& r : group().replicas()) bytes += r->weights.bytes() + r->bias.bytes();
  return bytes;
}

size_t Head::gradient_bytes() const {
  size_t bytes = 0;
  for (const auto& r : group().replicas()) bytes += r->grad.bytes() + r->grad_bias.bytes();
  return bytes;
}

size_t Head::workspace_bytes() const {
  size_t bytes = 0;
  for (const auto& r : group().replicas()) bytes += r->scratch_bytes.load();
  return bytes;
}

OptimizerFootprint Head::optimizer_bytes() const {
  absl::MutexLock state(&state_mu_);
  return optimizer_footprint_;  // over every replica: each holds the state of its rows
}

uint64_t Head::weights_version() const {
  absl::MutexLock state(&state_mu_);
  return version_;
}

v1::HeadInfo Head::Info() const {
  v1::HeadInfo info;
  *info.mutable_spec() = spec_;
  absl::MutexLock state(&state_mu_);
  *info.mutable_spec()->mutable_default_options() = defaults_;
  *info.mutable_spec()->mutable_optimizer() = optimizer_spec_;
  info.mutable_spec()->set_matmul_precision(ToProto(group().precision()));
  if (SpreadPlacement(spec_.placement())) {
    // The placement as held (spec_ keeps the one asked for: 0 devices means all, and a restore
    // onto a smaller server holds fewer).
    info.mutable_spec()->mutable_placement()->set_devices(group().size());
  }
  info.set_optimizer_step(optimizer_step_);
  info.set_weights_version(version_);
  info.set_tokens_since_pull(window_.tokens());
  info.set_microbatches_since_pull(window_.microbatches());
  info.set_tokens_total(window_.tokens_total());
  info.set_microbatches_total(window_.microbatches_total());
  info.mutable_memory()->set_weights_bytes(weights_bytes());
  info.mutable_memory()->set_gradient_bytes(gradient_bytes());
  info.mutable_memory()->set_workspace_bytes(workspace_bytes());
  info.mutable_memory()->set_master_weights_bytes(optimizer_footprint_.master);
  info.mutable_memory()->set_optimizer_state_bytes(optimizer_footprint_.state);
  for (DeviceShare& share : MemoryByDeviceLocked()) {
    info.add_devices(share.device->device_description());
    *info.add_device_memory() = std::move(share.memory);
  }
  info.set_device(info.devices(0));
  return info;
}

size_t Head::StashBytes(const kernels::Backend* device) const {
  return scratch_.StashBytes(device);
}

size_t Head::ReleaseStashes(const kernels::Backend* device) {
  return scratch_.ReleaseStashes(device);
}

void Head::RetryStashes(const kernels::Backend* device) { scratch_.RetryStashes(device); }

size_t Head::TryReleaseStashes(const kernels::Backend* device) {
  return scratch_.TryReleaseStashes(device);
}

std::vector<Head::DeviceShare> Head::MemoryByDevice() const {
  absl::MutexLock state(&state_mu_);
  return MemoryByDeviceLocked();
}

std::vector<Head::DeviceShare> Head::MemoryByDeviceLocked() const {
  std::vector<DeviceShare> shares;
  for (const auto& r : group().replicas()) {
    const OptimizerFootprint own =
        OptimizerBytes(optimizer_spec_, dtype_, static_cast<uint64_t>(group().RowElements(*r)));
    DeviceShare& share = shares.emplace_back();
    share.device = &r->backend;
    share.memory.set_weights_bytes(r->weights.bytes() + r->bias.bytes());
    share.memory.set_gradient_bytes(r->grad.bytes() + r->grad_bias.bytes());
    share.memory.set_workspace_bytes(r->scratch_bytes.load());
    share.memory.set_master_weights_bytes(own.master);
    share.memory.set_optimizer_state_bytes(own.state);
  }
  return shares;
}

}  // namespace losshead::server
