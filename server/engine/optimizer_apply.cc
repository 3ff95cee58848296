// Head's server-side optimizer: choosing one (SetOptimizer, and Create through InstallOptimizer)
// and applying it. An apply cuts the gradient window exactly as a pull with reset does, under the
// compute lock: every micro-batch is wholly in the step or wholly in the next window.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"
#include "server/engine/head_internal.h"
#include "server/engine/host_tensors.h"
#include "server/engine/process_window.h"
#include "server/engine/request_fingerprint.h"

namespace losshead::server {
namespace {

// torch.nn.utils.clip_grad_norm_'s guard against a zero norm.
constexpr double kClipEpsilon = 1e-6;

absl::Status FiniteAbove(double value, bool or_equal, absl::string_view field) {
  if (std::isfinite(value) && (value > 0 || (or_equal && value == 0))) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be finite and ", or_equal ? ">= 0" : "> 0", ", got ", value));
}

// What can be checked without the head: the request's own fields.
absl::Status ValidateApplyRequest(const v1::ApplyOptimizerRequest& r) {
  if (r.client_id().empty()) return absl::InvalidArgumentError("client_id must not be empty");
  if (r.step_key() < 1) return absl::InvalidArgumentError("step_key must be >= 1");
  if (r.has_grad_divisor()) {
    LOSSHEAD_RETURN_IF_ERROR(FiniteAbove(r.grad_divisor(), false, "grad_divisor"));
  }
  if (r.has_max_norm()) LOSSHEAD_RETURN_IF_ERROR(FiniteAbove(r.max_norm(), false, "max_norm"));
  if (r.params().has_bias_weight_decay()) {
    LOSSHEAD_RETURN_IF_ERROR(
        FiniteAbove(r.params().bias_weight_decay(), true, "params.bias_weight_decay"));
  }
  return FiniteAbove(r.trunk_grad_sq_norm(), true, "trunk_grad_sq_norm");
}

// Refuses a step that would carry a weight past its dtype's range, or a master or state value
// past fp32's (FAILED_PRECONDITION, nothing changed), and says how large each replica's rows may
// be after it. Where a replica's rows have known bounds that kernels::StepMagnitudeBound keeps in
// range, its step cannot overflow and nothing runs; elsewhere CheckOptimizerStep reads the rows
// once (about half the bytes of the step itself). `grad_sq[rank]`: the squared norm of that
// replica's rows of dW, which bounds each of its elements.
absl::StatusOr<std::vector<kernels::OptimizerMagnitudes>> CheckStepStaysInRange(
    ReplicaGroup& group, const kernels::OptimizerProblem& problem,
    const std::vector<double>& grad_sq) {
  const size_t esize = kernels::DTypeSize(problem.dtype);
  std::vector<kernels::OptimizerMagnitudes> after(group.size());
  std::vector<kernels::OptimizerCheck> checks(group.size());
  std::vector<bool> checked(group.size(), false);
  for (const auto& r : group.replicas()) {
    kernels::OptimizerProblem own = problem;
    own.count = group.RowElements(*r);
    if (r->optimizer.magnitudes.has_value()) {
      after[r->rank] =
          kernels::StepMagnitudeBound(own, *r->optimizer.magnitudes, std::sqrt(grad_sq[r->rank]));
      if (kernels::StepStaysInRange(problem.dtype, after[r->rank])) continue;
    }
    checked[r->rank] = true;
    char* weights = r->weights.as<char>() + head_internal::DeviceRowByteOffset(group, *r, esize);
    float* grad = r->grad.as<float>() + group.DeviceRowOffset(*r);
    auto* result = r->optimizer.check.as<kernels::OptimizerCheck>();
    LOSSHEAD_RETURN_IF_ERROR(r->backend.CheckOptimizerStep(
        own, KernelTensors(r->optimizer, weights, grad), result, *r->stream));
    LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToHost(&checks[r->rank], result,
                                                   sizeof(kernels::OptimizerCheck), *r->stream));
  }
  if (std::find(checked.begin(), checked.end(), true) == checked.end()) return after;
  LOSSHEAD_RETURN_IF_ERROR(group.Synchronize());
  // SGD without momentum neither reads nor writes its momentum buffer: the check saw none of it,
  // and what it holds stays as large as it was; unknown, it keeps later applies checking until
  // one with momentum has read it.
  const auto* sgd = std::get_if<kernels::SgdOptions>(&problem.options);
  const bool keeps_state_a = sgd != nullptr && sgd->momentum == 0.0f;
  uint64_t nonfinite = 0;
  for (const auto& r : group.replicas()) {
    const int i = r->rank;
    if (!checked[i]) continue;
    nonfinite += checks[i].nonfinite;
    after[i] = {
        .weight = checks[i].weight, .state_a = checks[i].state_a, .state_b = checks[i].state_b};
    if (keeps_state_a) {
      after[i].state_a = r->optimizer.magnitudes.has_value()
                             ? r->optimizer.magnitudes->state_a
                             : std::numeric_limits<double>::infinity();
    }
  }
  if (nonfinite > 0) {
    const char* largest = problem.dtype == kernels::DType::kFP16   ? "65504"
                          : problem.dtype == kernels::DType::kBF16 ? "3.39e38"
                                                                   : "3.40e38";
    return absl::FailedPreconditionError(absl::StrCat(
        "this optimizer step would overflow ", nonfinite,
        " element(s): ", kernels::DTypeName(problem.dtype), " weights hold up to ", largest,
        ", their fp32 master and the optimizer state up to 3.40e38; nothing was stepped: give a ",
        "smaller lr or weight_decay, or pull with reset to drop the window"));
  }
  return after;
}

}  // namespace

absl::StatusOr<std::vector<OptimizerBuffers>> Head::AllocateOptimizers(
    const v1::OptimizerSpec& spec) const {
  std::vector<OptimizerBuffers> buffers;
  for (const auto& r : group().replicas()) {
    LOSSHEAD_ASSIGN_OR_RETURN(OptimizerBuffers own,
                              AllocateOptimizer(r->backend, spec, dtype_,
                                                static_cast<uint64_t>(group().RowElements(*r))));
    buffers.push_back(std::move(own));
  }
  return buffers;
}

absl::Status Head::SetOptimizer(const v1::OptimizerSpec& spec) {
  LOSSHEAD_RETURN_IF_ERROR(ValidateOptimizerSpec(spec));
  // Allocated before the lock, so that steps go on meanwhile and a failure changes nothing.
  LOSSHEAD_ASSIGN_OR_RETURN(std::vector<OptimizerBuffers> buffers, AllocateOptimizers(spec));
  ReplicaGroup::Cut cut(group());
  return InstallOptimizer(std::move(buffers));
}

absl::Status Head::InstallOptimizer(std::vector<OptimizerBuffers> buffers) {
  for (size_t i = 0; i < buffers.size(); ++i) {
    Replica& r = group()[static_cast<int>(i)];
    for (kernels::DeviceBuffer& state : buffers[i].state) {
      LOSSHEAD_RETURN_IF_ERROR(r.backend.Memset(state.data(), 0, state.bytes(), *r.stream));
    }
    buffers[i].master_version = 0;  // not yet taken from W: SyncMaster does it
  }
  LOSSHEAD_RETURN_IF_ERROR(group().Synchronize());
  auto swap_all = [&] {
    for (size_t i = 0; i < buffers.size(); ++i) {
      std::swap(group()[static_cast<int>(i)].optimizer, buffers[i]);
    }
  };
  swap_all();
  absl::Status synced = SyncMaster();
  if (!synced.ok()) {
    swap_all();  // the old optimizer stays
    return synced;
  }
  const v1::OptimizerSpec& spec = group()[0].optimizer.spec;
  if (has_bias()) {
    // b's state starts afresh with W's.
    bias_.optimizer_state.assign(StateBufferCount(spec),
                                 std::vector<float>(static_cast<size_t>(vocab_size()), 0.0f));
  }
  absl::MutexLock state(&state_mu_);
  optimizer_spec_ = spec;
  optimizer_step_ = 0;
  optimizer_footprint_ = OptimizerBytes(
      spec, dtype_, static_cast<uint64_t>(vocab_size()) * static_cast<uint64_t>(hidden_size()));
  return absl::OkStatus();
}

absl::Status Head::SyncMaster() {
  uint64_t version;
  {
    absl::MutexLock state(&state_mu_);
    version = version_;
  }
  for (const auto& r : group().replicas()) {
    OptimizerBuffers& optimizer = r->optimizer;
    if (optimizer.master_version == version) continue;
    optimizer.magnitudes.reset();  // master is taken anew (or, for fp32, W was pushed)
    if (optimizer.master.data() != nullptr) {
      // This replica's rows of W -> fp32 through the host in blocks: only a push or a new
      // optimizer gets here.
      const size_t count = optimizer.master.bytes() / sizeof(float);
      const size_t esize = kernels::DTypeSize(dtype_);
      const char* rows =
          r->weights.as<char>() + head_internal::DeviceRowByteOffset(group(), *r, esize);
      std::string w(std::min(count, kConvertBlock) * esize, '\0');
      std::vector<float> block(std::min(count, kConvertBlock));
      for (size_t i = 0; i < count; i += kConvertBlock) {
        const size_t n = std::min(kConvertBlock, count - i);
        LOSSHEAD_RETURN_IF_ERROR(
            r->backend.CopyToHost(w.data(), rows + i * esize, n * esize, *r->stream));
        LOSSHEAD_RETURN_IF_ERROR(r->stream->Synchronize());
        kernels::ToFloat(dtype_, w.data(), block.data(), n);
        LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToDevice(
            optimizer.master.as<float>() + i, block.data(), n * sizeof(float), *r->stream));
        LOSSHEAD_RETURN_IF_ERROR(r->stream->Synchronize());  // the host block is reused
      }
    }
    optimizer.master_version = version;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> Head::GatherDoubles(absl::string_view what,
                                                        const std::vector<double>& mine) {
  if (options_.process_window == nullptr) {
    return absl::InternalError("a head sharded across processes without its process group");
  }
  LOSSHEAD_ASSIGN_OR_RETURN(std::vector<std::string> all,
                            options_.process_window->AllGather(
                                what, absl::string_view(reinterpret_cast<const char*>(mine.data()),
                                                        mine.size() * sizeof(double))));
  std::vector<double> every;
  for (const std::string& bytes : all) {
    const size_t at = every.size();
    every.resize(at + bytes.size() / sizeof(double));
    std::memcpy(every.data() + at, bytes.data(), bytes.size() / sizeof(double) * sizeof(double));
  }
  return every;
}

absl::StatusOr<v1::ApplyOptimizerResponse> Head::ApplyOptimizer(
    const v1::ApplyOptimizerRequest& request) {
  LOSSHEAD_RETURN_IF_ERROR(ValidateApplyRequest(request));
  std::string fingerprint = ApplyFingerprint(request);
  ReplicaGroup::Cut cut(group());
  LOSSHEAD_ASSIGN_OR_RETURN(std::optional<v1::ApplyOptimizerResponse> replay,
                            applies_.Find(request.client_id(), request.step_key(), fingerprint));
  if (replay.has_value()) return *std::move(replay);
  // Every replica's optimizer has the same spec, step and momentum state; each has its rows.
  const OptimizerBuffers& first = group()[0].optimizer;
  LOSSHEAD_ASSIGN_OR_RETURN(kernels::OptimizerOptions options,
                            KernelOptions(first, request.params()));
  const int64_t count = vocab_size() * hidden_size();
  kernels::OptimizerProblem problem{.count = count,
                                    .dtype = dtype_,
                                    .options = options,
                                    .step = static_cast<int64_t>(first.step + 1)};
  if (absl::Status s = kernels::ValidateOptimizerProblem(problem); !s.ok()) {
    // The kernels judge the fp32 values: a double that rounds to 0, 1 or Inf reads as that, so
    // the values as sent go with the verdict.
    return absl::InvalidArgumentError(
        absl::StrCat(s.message(), " (the step computes in fp32; ",
                     "params as sent: ", request.params().ShortDebugString(), ")"));
  }
  LOSSHEAD_RETURN_IF_ERROR(CheckOptimizerBuffers(first, options));

  v1::ApplyOptimizerResponse response;
  v1::GradientSummary& window = *response.mutable_window();
  {
    absl::MutexLock state(&state_mu_);
    if (request.has_expected_weights_version() && request.expected_weights_version() != version_) {
      return absl::FailedPreconditionError(
          absl::StrCat("expected_weights_version is ", request.expected_weights_version(),
                       " but the head's weights are at version ", version_));
    }
    window_.Summarize(&window);  // reset once the step has run
  }
  // Across processes: dW becomes the group's window (every process's, summed), and the window's
  // counters the group's, before anything is decided on them, so that every process decides the
  // same. Until the step is committed, a refusal puts this process's own window back.
  // An output bias's db goes after dW in the same sum, and is put back on the devices (each row
  // in one accumulator) the same way.
  // Sharded across processes instead: each process steps its own rows with its own dW (no sum:
  // the rows are disjoint), and what is decided on the whole of dW (the norm, the range checks)
  // is gathered from every process first.
  const bool sharded_across = across_processes();
  const bool across = options_.process_window != nullptr && !sharded_across;
  std::string own_window;
  bool committed = false;
  const auto bias_part = [&](const std::string& window) {
    const float* db = reinterpret_cast<const float*>(window.data()) + count;
    return std::vector<float>(db, db + vocab_size());
  };
  absl::Cleanup put_back = [&] {
    if (across && !committed && !own_window.empty()) {
      head_internal::WriteOwnedGrad(group(), own_window.data()).IgnoreError();
      if (has_bias()) RestoreGradBias(group(), bias_part(own_window)).IgnoreError();
    }
  };
  if (across) {
    LOSSHEAD_RETURN_IF_ERROR(placement_->ReduceGradientToOwners());
    std::string summed(tensor_elements() * sizeof(float), '\0');
    LOSSHEAD_RETURN_IF_ERROR(head_internal::ReadOwnedGrad(group(), summed.data()));
    if (has_bias()) {
      LOSSHEAD_ASSIGN_OR_RETURN(const std::vector<float> db, ReadGradBias(group()));
      std::memcpy(summed.data() + static_cast<size_t>(count) * sizeof(float), db.data(),
                  db.size() * sizeof(float));
    }
    own_window = summed;
    LOSSHEAD_RETURN_IF_ERROR(options_.process_window->Sum(
        std::span<float>(reinterpret_cast<float*>(summed.data()), tensor_elements()), window));
    LOSSHEAD_RETURN_IF_ERROR(head_internal::WriteOwnedGrad(group(), summed.data()));
    if (has_bias()) LOSSHEAD_RETURN_IF_ERROR(RestoreGradBias(group(), bias_part(summed)));
  }
  if (!request.has_grad_divisor() && window.token_count() == 0) {
    return absl::FailedPreconditionError(
        "the gradient window holds no tokens and no grad_divisor was given");
  }
  const double divisor = request.has_grad_divisor() ? request.grad_divisor()
                                                    : static_cast<double>(window.token_count());

  // ZeRO-1: dW reduced to the replicas that own its rows; each takes the squared norm of its
  // rows, added here in rank order (the same bits on every run).
  if (!across) LOSSHEAD_RETURN_IF_ERROR(placement_->ReduceGradientToOwners());
  std::vector<double> partial(group().size(), 0.0);
  for (const auto& r : group().replicas()) {
    LOSSHEAD_RETURN_IF_ERROR(r->backend.SquaredNorm(
        r->grad.as<float>() + group().DeviceRowOffset(*r), group().RowElements(*r),
        r->optimizer.norm.as<double>(), *r->stream));
    LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToHost(&partial[r->rank], r->optimizer.norm.data(),
                                                   sizeof(double), *r->stream));
  }
  LOSSHEAD_RETURN_IF_ERROR(group().Synchronize());
  double squared = 0;
  if (sharded_across) {
    // Every shard's, in global rank order: the one-process sharded head's sum, bit for bit.
    LOSSHEAD_ASSIGN_OR_RETURN(std::vector<double> every,
                              GatherDoubles("dW's squared norms", partial));
    for (double p : every) squared += p;
  } else {
    for (double p : partial) squared += p;
  }
  // An output bias is part of the head's gradient: its norm, its clipping, its step. Sharded
  // across processes, every process takes the whole of db (every process's rows), so that each
  // decides the norm alike and steps every value of b alike, as one process does.
  std::vector<float> grad_bias;
  if (has_bias()) {
    LOSSHEAD_ASSIGN_OR_RETURN(grad_bias, GroupGradBias());
    squared += SquaredNorm(grad_bias);
  }
  if (!std::isfinite(squared)) {
    return absl::FailedPreconditionError(
        "the gradient window holds NaN or Inf (or overflows); nothing was stepped: pull it to "
        "inspect, or pull with reset to drop it");
  }
  const double head_norm = std::sqrt(squared) / divisor;
  const double total_norm = std::sqrt(head_norm * head_norm + request.trunk_grad_sq_norm());
  const double coefficient = request.has_max_norm()
                                 ? std::min(1.0, request.max_norm() / (total_norm + kClipEpsilon))
                                 : 1.0;
  problem.grad_scale = static_cast<float>(coefficient / divisor);
  // A divisor so small that the scale overflows fp32 is the caller's error, caught before the step.
  LOSSHEAD_RETURN_IF_ERROR(kernels::ValidateOptimizerProblem(problem));
  // No element of dW exceeds its norm: a scaled norm within fp32 keeps every scaled element
  // finite, where an overflow would step Inf into the moments and NaN (Inf / Inf) into W.
  if (!(std::sqrt(squared) * problem.grad_scale < std::numeric_limits<float>::max())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the gradient window divided by ", divisor,
        " overflows fp32; nothing was stepped: give a larger grad_divisor, or pull with reset "
        "to drop the window"));
  }
  LOSSHEAD_RETURN_IF_ERROR(SyncMaster());
  absl::StatusOr<std::vector<kernels::OptimizerMagnitudes>> checked =
      CheckStepStaysInRange(group(), problem, partial);
  // W's new bound over every process's rows (it bounds the micro-batches every process runs).
  double weight_bound = 0;
  if (checked.ok()) {
    for (const kernels::OptimizerMagnitudes& m : *checked) {
      weight_bound = std::max(weight_bound, m.weight * (1.0 + 1.0 / 128));
    }
  }
  if (sharded_across) {
    // A refusal anywhere is every process's: the verdicts and bounds are gathered (a refusal is
    // sent as NaN), before anything is stepped.
    const std::vector<double> mine = {checked.ok() ? weight_bound : std::nan("")};
    LOSSHEAD_ASSIGN_OR_RETURN(std::vector<double> every,
                              GatherDoubles("the optimizer step's range checks", mine));
    LOSSHEAD_RETURN_IF_ERROR(checked.status());
    for (size_t p = 0; p < every.size(); ++p) {
      if (std::isnan(every[p])) {
        return absl::FailedPreconditionError(absl::StrCat(
            "this optimizer step would overflow on process ", p,
            " of the head's group (its rows); nothing was stepped on any process: give a "
            "smaller lr or weight_decay, or pull with reset to drop the window"));
      }
      weight_bound = std::max(weight_bound, every[p]);
    }
  }
  LOSSHEAD_ASSIGN_OR_RETURN(std::vector<kernels::OptimizerMagnitudes> after, std::move(checked));
  // b's step, computed before W's so that a refusal changes nothing; committed after it.
  HeadBias stepped_bias;
  if (has_bias()) {
    const v1::OptimizerHyperParams& p = request.params();
    LOSSHEAD_RETURN_IF_ERROR(
        StepBias(problem, p.has_bias_weight_decay() ? p.bias_weight_decay() : p.weight_decay(),
                 bias_, std::move(grad_bias), &stepped_bias));
  }
  // Each replica steps its own rows (zeroing them in dW; its other rows are zero once reduced),
  // then every replica takes the others' new rows of W.
  const size_t esize = kernels::DTypeSize(dtype_);
  for (const auto& r : group().replicas()) {
    kernels::OptimizerProblem own = problem;
    own.count = group().RowElements(*r);
    char* weights = r->weights.as<char>() + head_internal::DeviceRowByteOffset(group(), *r, esize);
    float* grad = r->grad.as<float>() + group().DeviceRowOffset(*r);
    LOSSHEAD_RETURN_IF_ERROR(
        r->backend.OptimizerStep(own, KernelTensors(r->optimizer, weights, grad), *r->stream));
  }
  // From here the step is taken: dW's rows are stepped (and zeroed) on every process alike.
  committed = true;
  LOSSHEAD_RETURN_IF_ERROR(placement_->GatherWeights());
  LOSSHEAD_RETURN_IF_ERROR(group().Synchronize());
  if (has_bias()) {
    bias_ = std::move(stepped_bias);
    LOSSHEAD_RETURN_IF_ERROR(CopyBiasIn(group(), bias_.values));
    LOSSHEAD_RETURN_IF_ERROR(ZeroGradBias(group()));
  }

  const bool momentum_started = [&] {
    const auto* sgd = std::get_if<kernels::SgdOptions>(&problem.options);
    return sgd != nullptr && sgd->momentum != 0.0f;
  }();
  {
    absl::MutexLock state(&state_mu_);
    ++version_;
    for (const auto& r : group().replicas()) {
      r->optimizer.step += 1;
      if (momentum_started) r->optimizer.momentum_started = true;
      r->optimizer.master_version = version_;
      r->optimizer.magnitudes = after[r->rank];
    }
    optimizer_step_ = first.step;
    window_.Reset();
    // The magnitude bounds of the new master weights bound W too, once rounded up to its dtype
    // (by less than 2^-8 of a value).
    weight_abs_ = weight_bound;
    weight_abs_exact_ = false;
    response.set_weights_version(version_);
  }
  window.set_vocab_size(vocab_size());
  window.set_hidden_size(hidden_size());
  window.set_was_reset(true);
  response.set_head_grad_norm(head_norm);
  response.set_total_grad_norm(total_norm);
  response.set_clip_coefficient(coefficient);
  response.set_optimizer_step(first.step);
  applies_.Record(request.client_id(), request.step_key(), std::move(fingerprint), response);
  return response;
}

}  // namespace losshead::server
