// The head itself: creation (spec validation, allocation, initial W), info and default options,
// and the host conversions its other parts share. The step pipeline, the gradient window and the
// checkpoint cut are in step_pipeline.cc, gradient_window.cc and head_checkpoint.cc.
#include "server/engine/head.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head_internal.h"
#include "server/engine/proto_convert.h"
#include "server/engine/status_macros.h"

namespace losshead::server {
namespace head_internal {
namespace {

void ConvertTensor(kernels::DType from, const char* src, kernels::DType to, char* dst,
                   size_t count) {
  if (from == to) {
    std::memcpy(dst, src, count * kernels::DTypeSize(from));
    return;
  }
  std::vector<float> block(std::min(count, kConvertBlock));
  for (size_t i = 0; i < count; i += kConvertBlock) {
    const size_t n = std::min(kConvertBlock, count - i);
    kernels::ToFloat(from, src + i * kernels::DTypeSize(from), block.data(), n);
    kernels::FromFloat(to, block.data(), dst + i * kernels::DTypeSize(to), n);
  }
}

}  // namespace

std::string Convert(kernels::DType from, absl::string_view src, kernels::DType to) {
  const size_t count = src.size() / kernels::DTypeSize(from);
  std::string out(count * kernels::DTypeSize(to), '\0');
  ConvertTensor(from, src.data(), to, out.data(), count);
  return out;
}

absl::Status AsResourceExhausted(const absl::Status& status, absl::string_view what) {
  if (status.ok()) return status;
  return absl::ResourceExhaustedError(
      absl::StrCat("cannot allocate ", what, ": ", status.message()));
}

}  // namespace head_internal

namespace {

using head_internal::AsResourceExhausted;
using head_internal::kConvertBlock;

// Idle dH buffers a head keeps for reuse: a few full-size (8192 x 4096 bf16) results, about what
// its I/O slots finish while the cache gives older ones back.
constexpr size_t kIdleResultBytes = size_t{256} << 20;

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  for (char c : name) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

absl::Status Head::ValidateSpec(const v1::HeadSpec& spec) {
  if (!ValidName(spec.name())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head name must match [A-Za-z0-9_.-]{1,128}, got '", spec.name().substr(0, 160), "'"));
  }
  if (spec.vocab_size() < 1 || spec.vocab_size() > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size must be in [1, 2^31), got ", spec.vocab_size()));
  }
  if (spec.hidden_size() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_size must be >= 1, got ", spec.hidden_size()));
  }
  if (absl::Status s = FloatDType(spec.weight_dtype(), "weight_dtype").status(); !s.ok()) return s;
  if (spec.init().has_normal()) {
    const float std = spec.init().normal().std();
    if (!(std > 0.0f) || !std::isfinite(std)) {
      return absl::InvalidArgumentError(
          absl::StrCat("init.normal.std must be finite and > 0, got ", std));
    }
  }
  LOSSHEAD_RETURN_IF_ERROR(ValidateOptimizerSpec(spec.optimizer()));
  return ValidateLossOptions(spec.default_options());
}

Head::Head(kernels::Backend& backend, const v1::HeadSpec& spec, kernels::DType dtype,
           const HeadOptions& options)
    : backend_(backend),
      spec_(spec),
      dtype_(dtype),
      options_(options),
      results_(std::make_shared<ResultPool>(kIdleResultBytes)),
      cache_(options.idempotency_window, options.idempotency_max_bytes_per_client),
      applies_(options.apply_window) {
  {
    absl::MutexLock lock(&slots_mu_);
    for (size_t i = 0; i < kIoSlots; ++i) free_slots_.push_back(std::make_unique<IoSlot>());
  }
  absl::MutexLock lock(&state_mu_);
  defaults_ = spec.default_options();
}

Head::~Head() {
  // Work still queued on the stream must finish before the buffers it uses are freed (the slots'
  // streams wait for their own work when they are destroyed).
  if (stream_ != nullptr) stream_->Synchronize().IgnoreError();
}

absl::StatusOr<std::shared_ptr<Head>> Head::Create(kernels::Backend& backend,
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
  // Admission: refuse a head whose tensors cannot all fit before allocating any of them (an
  // optimizer's state is several times W). A backend that cannot tell (total 0) is not checked.
  const OptimizerFootprint optimizer = OptimizerBytes(spec.optimizer(), dtype, v * d);
  const uint64_t needed = v * d * (kernels::DTypeSize(dtype) + sizeof(float)) + optimizer.total();
  const kernels::MemoryInfo memory = backend.memory_info();
  if (memory.total_bytes > 0 && needed > memory.free_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a ", v, " x ", d, " head needs ", needed, " bytes (W, dW and the optimizer's ",
        optimizer.total(), ") but the device has ", memory.free_bytes, " free"));
  }
  std::shared_ptr<Head> head(new Head(backend, spec, dtype, options));
  LOSSHEAD_RETURN_IF_ERROR(head->Initialize(options.workspace_budget_bytes, true));
  if (HasOptimizer(spec.optimizer())) {
    LOSSHEAD_ASSIGN_OR_RETURN(OptimizerBuffers buffers,
                              AllocateOptimizer(backend, spec.optimizer(), dtype, v * d));
    absl::MutexLock lock(&head->compute_mu_);
    LOSSHEAD_RETURN_IF_ERROR(head->InstallOptimizer(std::move(buffers)));
  }
  return head;
}

absl::Status Head::Initialize(size_t workspace_budget, bool init_weights) {
  absl::MutexLock lock(&compute_mu_);
  const size_t count = static_cast<size_t>(vocab_size()) * hidden_size();
  const size_t esize = kernels::DTypeSize(dtype_);
  {
    auto w = backend_.Allocate(count * esize);
    if (!w.ok()) return AsResourceExhausted(w.status(), "weights");
    weights_ = std::move(*w);
    auto g = backend_.Allocate(count * sizeof(float));
    if (!g.ok()) return AsResourceExhausted(g.status(), "the gradient accumulator");
    grad_ = std::move(*g);
  }
  LOSSHEAD_ASSIGN_OR_RETURN(stream_, backend_.CreateStream());
  // The workspace itself is allocated on first use, sized for the micro-batch; here we only make
  // sure some chunk size fits the budget so that a head that could never step is refused now.
  kernels::Problem probe{.n = 1, .d = hidden_size(), .v = vocab_size(), .dtype = dtype_};
  LOSSHEAD_RETURN_IF_ERROR(backend_.WorkspaceBytes(probe, workspace_budget).status());

  LOSSHEAD_RETURN_IF_ERROR(backend_.Memset(grad_.data(), 0, grad_.bytes(), *stream_));
  if (!init_weights) return stream_->Synchronize();  // a restore overwrites W
  if (!spec_.init().has_normal()) {
    LOSSHEAD_RETURN_IF_ERROR(backend_.Memset(weights_.data(), 0, weights_.bytes(), *stream_));
    return stream_->Synchronize();
  }
  std::mt19937_64 rng(spec_.init().normal().seed());
  std::normal_distribution<float> normal(0.0f, spec_.init().normal().std());
  std::vector<float> block(std::min(count, kConvertBlock));
  std::string converted(block.size() * esize, '\0');
  for (size_t i = 0; i < count; i += kConvertBlock) {
    const size_t n = std::min(kConvertBlock, count - i);
    for (size_t j = 0; j < n; ++j) block[j] = normal(rng);
    kernels::FromFloat(dtype_, block.data(), converted.data(), n);
    LOSSHEAD_RETURN_IF_ERROR(backend_.CopyToDevice(weights_.as<char>() + i * esize,
                                                   converted.data(), n * esize, *stream_));
    // The host block is reused for the next piece: the copy must have landed.
    LOSSHEAD_RETURN_IF_ERROR(stream_->Synchronize());
  }
  return absl::OkStatus();
}

absl::Status Head::SetDefaultOptions(const v1::LossOptions& options) {
  LOSSHEAD_RETURN_IF_ERROR(ValidateLossOptions(options));
  absl::MutexLock state(&state_mu_);
  defaults_ = options;
  return absl::OkStatus();
}

size_t Head::workspace_bytes() const {
  absl::MutexLock state(&state_mu_);
  return device_scratch_bytes_;
}

OptimizerFootprint Head::optimizer_bytes() const {
  absl::MutexLock state(&state_mu_);
  return optimizer_footprint_;
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
  info.set_optimizer_step(optimizer_step_);
  info.set_weights_version(version_);
  info.set_tokens_since_pull(tokens_since_pull_);
  info.set_microbatches_since_pull(microbatches_since_pull_);
  info.set_tokens_total(tokens_total_);
  info.set_microbatches_total(microbatches_total_);
  info.mutable_memory()->set_weights_bytes(weights_.bytes());
  info.mutable_memory()->set_gradient_bytes(grad_.bytes());
  info.mutable_memory()->set_workspace_bytes(device_scratch_bytes_);
  info.mutable_memory()->set_master_weights_bytes(optimizer_footprint_.master);
  info.mutable_memory()->set_optimizer_state_bytes(optimizer_footprint_.state);
  info.set_device(backend_.device_description());
  return info;
}

}  // namespace losshead::server
