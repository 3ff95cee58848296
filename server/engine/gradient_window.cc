// Head's gradient window: what the micro-batches accumulated since the last cut, and W. A pull
// copies dW out with the counters it covers and, with reset, opens the next window in the same
// critical section; a push replaces or adds to W and bumps the version; a download copies W out.
// The server-side optimizer step (optimizer_apply.cc) cuts the window the same way as a pull with
// reset.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"
#include "server/engine/head_internal.h"
#include "server/engine/head_optimizer.h"
#include "server/engine/host_tensors.h"
#include "server/engine/process_window.h"
#include "server/engine/proto_convert.h"
#include "server/engine/result_pool.h"
#include "server/engine/transfer_buffers.h"

namespace losshead::server {

using head_internal::DeviceRowByteOffset;
using head_internal::OwnRowBytes;
using head_internal::RowByteOffset;
using head_internal::RowBytes;

namespace {

ResultPool& TransferPool() {
  // Smaller transfers go through the allocator's own free lists without page faults.
  static ResultPool* const pool = new ResultPool(kIdleTransferBytes, size_t{16} << 20);
  return *pool;
}

}  // namespace

std::string TakeTransferBuffer(size_t bytes) { return TransferPool().Take(bytes); }

void GiveTransferBuffer(std::string buffer) { TransferPool().Give(std::move(buffer)); }

namespace {

// The dtype a pull answers in (UNSPECIFIED: FP32).
absl::StatusOr<v1::DType> PullDType(v1::DType dtype) {
  if (dtype == v1::DTYPE_UNSPECIFIED) return v1::DTYPE_FP32;
  if (dtype != v1::DTYPE_FP32 && dtype != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("pull dtype must be DTYPE_FP32 or DTYPE_BF16, got ", static_cast<int>(dtype)));
  }
  return dtype;
}

}  // namespace

namespace head_internal {

absl::Status ReadOwnedGrad(ReplicaGroup& group, char* host) {
  for (const auto& r : group.replicas()) {
    LOSSHEAD_RETURN_IF_ERROR(
        r->backend.CopyToHost(host + RowByteOffset(group, *r, sizeof(float)),
                              r->grad.as<char>() + DeviceRowByteOffset(group, *r, sizeof(float)),
                              RowBytes(group, *r, sizeof(float)), *r->stream));
  }
  return group.Synchronize();
}

absl::Status WriteOwnedGrad(ReplicaGroup& group, const char* host) {
  for (const auto& r : group.replicas()) {
    LOSSHEAD_RETURN_IF_ERROR(
        r->backend.CopyToDevice(r->grad.as<char>() + DeviceRowByteOffset(group, *r, sizeof(float)),
                                host + RowByteOffset(group, *r, sizeof(float)),
                                RowBytes(group, *r, sizeof(float)), *r->stream));
  }
  return group.Synchronize();
}

}  // namespace head_internal

namespace head_internal {

std::pair<size_t, size_t> OwnRowBytes(const ReplicaGroup& group, size_t element_bytes) {
  const auto& replicas = group.replicas();
  const size_t row = static_cast<size_t>(group.hidden_size()) * element_bytes;
  return {static_cast<size_t>(replicas.front()->rows.begin) * row,
          static_cast<size_t>(replicas.back()->rows.end) * row};
}

}  // namespace head_internal

absl::Status Head::GatherOtherRows(std::string& tensor, size_t element_bytes) {
  if (!across_processes()) return absl::OkStatus();
  if (options_.process_window == nullptr) {
    return absl::InternalError("a head sharded across processes without its process group");
  }
  const auto [begin, end] = OwnRowBytes(group(), element_bytes);
  return options_.process_window->GatherRows("W's rows", tensor, begin, end);
}

absl::StatusOr<std::vector<float>> Head::GroupGradBias() {
  LOSSHEAD_ASSIGN_OR_RETURN(std::vector<float> db, ReadGradBias(group()));
  if (!across_processes()) return db;
  if (options_.process_window == nullptr) {
    return absl::InternalError("a head sharded across processes without its process group");
  }
  // db's rows are W's rows, one value each: this process's shards hold rows [first.begin,
  // last.end), contiguous in global shard order.
  const kernels::Shard first = group()[0].rows;
  const kernels::Shard last = group()[group().size() - 1].rows;
  std::string bytes(db.size() * sizeof(float), '\0');
  std::memcpy(bytes.data(), db.data(), bytes.size());
  LOSSHEAD_RETURN_IF_ERROR(options_.process_window->GatherRows(
      "db's rows", bytes, static_cast<size_t>(first.begin) * sizeof(float),
      static_cast<size_t>(last.end) * sizeof(float)));
  std::memcpy(db.data(), bytes.data(), bytes.size());
  return db;
}

void Head::WarnOfUnappliedWindowLocked() {
  const uint64_t limit = options_.window_warn_microbatches;
  if (!HasOptimizer(optimizer_spec_) || !window_.TakeWarning(limit)) return;
  std::fprintf(stderr,
               "losshead-server: head '%s' has a server-side optimizer and %llu micro-batches "
               "(%llu tokens) in its gradient window, counted over %s with no optimizer apply, "
               "pull with reset or discard (--unapplied_window_warn_microbatches=%llu): the "
               "training loop does not step this head or does not discard its window on "
               "zero_grad; logged once per window\n",
               name().c_str(), static_cast<unsigned long long>(window_.microbatches()),
               static_cast<unsigned long long>(window_.tokens()),
               absl::FormatDuration(absl::Trunc(window_.age(), absl::Seconds(1))).c_str(),
               static_cast<unsigned long long>(limit));
}

Head::WindowState Head::Window() const {
  absl::MutexLock state(&state_mu_);
  return WindowState{
      .microbatches = window_.microbatches(), .tokens = window_.tokens(), .age = window_.age()};
}

absl::StatusOr<v1::GradientSummary> Head::WindowSummary(v1::DType dtype, bool discard) {
  LOSSHEAD_ASSIGN_OR_RETURN(dtype, PullDType(dtype));
  v1::GradientSummary s;
  {
    // Without a discard the counters alone answer: a micro-batch updates them under state_mu_,
    // so they are read whole. A discard is a cut: every replica's compute lock.
    std::optional<ReplicaGroup::Cut> cut;
    if (discard) cut.emplace(group());
    // A head sharded across processes counts every micro-batch on every process: its counters
    // are the group's as they are.
    const bool summed = options_.process_window != nullptr && !across_processes();
    if (summed) {
      // The group's counters, summed before anything is dropped: a failure drops nothing.
      {
        absl::MutexLock state(&state_mu_);
        window_.Summarize(&s);
      }
      LOSSHEAD_RETURN_IF_ERROR(options_.process_window->SumCounters(s));
    }
    if (discard) {
      LOSSHEAD_RETURN_IF_ERROR(group().DiscardGradient());
      if (has_bias()) LOSSHEAD_RETURN_IF_ERROR(ZeroGradBias(group()));
    }
    absl::MutexLock state(&state_mu_);
    if (!summed) window_.Summarize(&s);
    if (discard) window_.Reset();
  }
  s.set_vocab_size(vocab_size());
  s.set_hidden_size(hidden_size());
  s.set_dtype(dtype);
  s.set_total_bytes(0);
  s.set_was_reset(discard);
  s.set_bias(has_bias());
  return s;
}

absl::StatusOr<GradientSnapshot> Head::PullGradient(v1::DType dtype, bool reset) {
  LOSSHEAD_ASSIGN_OR_RETURN(dtype, PullDType(dtype));
  GradientSnapshot snap;
  // Every byte is overwritten by the copies below; the reactor gives the buffer back once sent.
  snap.data = TakeTransferBuffer(tensor_elements() * sizeof(float));
  v1::GradientSummary& s = snap.summary;
  {
    ReplicaGroup::Cut cut(group());
    // Each replica copies its rows of the reduced dW (one copy per device, side by side) and,
    // with reset, zeroes them: its other rows are zero once reduced.
    LOSSHEAD_RETURN_IF_ERROR(placement_->ReduceGradientToOwners());
    // Across processes the rows are zeroed only once every process's window is summed: a cut that
    // fails there leaves this window as it was.
    const bool across = options_.process_window != nullptr;
    // Sharded across processes: this process's rows, then every other's gathered beside them.
    const bool sharded_across = across && across_processes();
    for (const auto& r : group().replicas()) {
      const size_t bytes = RowBytes(group(), *r, sizeof(float));
      char* rows = r->grad.as<char>() + DeviceRowByteOffset(group(), *r, sizeof(float));
      LOSSHEAD_RETURN_IF_ERROR(r->backend.CopyToHost(
          snap.data.data() + RowByteOffset(group(), *r, sizeof(float)), rows, bytes, *r->stream));
      if (reset && !across) LOSSHEAD_RETURN_IF_ERROR(r->backend.Memset(rows, 0, bytes, *r->stream));
    }
    LOSSHEAD_RETURN_IF_ERROR(group().Synchronize());
    if (has_bias()) {
      // db after dW, read in the same cut (and zeroed with it; across processes once summed).
      LOSSHEAD_ASSIGN_OR_RETURN(const std::vector<float> db, ReadGradBias(group()));
      std::memcpy(
          snap.data.data() + static_cast<size_t>(vocab_size()) * hidden_size() * sizeof(float),
          db.data(), db.size() * sizeof(float));
      if (reset && !across) LOSSHEAD_RETURN_IF_ERROR(ZeroGradBias(group()));
    }
    if (across) {
      v1::GradientSummary group_window;
      {
        absl::MutexLock state(&state_mu_);
        window_.Summarize(&group_window);
      }
      if (sharded_across) {
        const auto [begin, end] = OwnRowBytes(group(), sizeof(float));
        LOSSHEAD_RETURN_IF_ERROR(
            options_.process_window->GatherRows("a pull of dW's rows", snap.data, begin, end));
        if (has_bias()) {
          // db after dW: its rows are W's, one value each.
          const size_t at = static_cast<size_t>(vocab_size()) * hidden_size() * sizeof(float);
          const size_t row = static_cast<size_t>(hidden_size());
          LOSSHEAD_RETURN_IF_ERROR(options_.process_window->GatherRows(
              "a pull of db's rows", snap.data, at + begin / row, at + end / row));
        }
      } else {
        // dW and db (after it) in one sum: every element in fp64 in process order.
        LOSSHEAD_RETURN_IF_ERROR(options_.process_window->Sum(
            std::span<float>(reinterpret_cast<float*>(snap.data.data()), tensor_elements()),
            group_window));
      }
      if (reset) {
        for (const auto& r : group().replicas()) {
          char* rows = r->grad.as<char>() + DeviceRowByteOffset(group(), *r, sizeof(float));
          LOSSHEAD_RETURN_IF_ERROR(
              r->backend.Memset(rows, 0, RowBytes(group(), *r, sizeof(float)), *r->stream));
        }
        LOSSHEAD_RETURN_IF_ERROR(group().Synchronize());
        if (has_bias()) LOSSHEAD_RETURN_IF_ERROR(ZeroGradBias(group()));
      }
      absl::MutexLock state(&state_mu_);
      s = group_window;
      if (reset) window_.Reset();
    }
    if (!across) {
      absl::MutexLock state(&state_mu_);
      window_.Summarize(&s);
      if (reset) window_.Reset();
    }
  }
  if (dtype == v1::DTYPE_BF16) {
    std::string fp32 = std::move(snap.data);
    snap.data = ConvertOnHost(kernels::DType::kFP32, fp32, kernels::DType::kBF16);
    GiveTransferBuffer(std::move(fp32));
  }
  s.set_vocab_size(vocab_size());
  s.set_hidden_size(hidden_size());
  s.set_dtype(dtype);
  s.set_total_bytes(snap.data.size());
  s.set_was_reset(reset);
  s.set_bias(has_bias());
  return snap;
}

absl::StatusOr<uint64_t> Head::PushWeights(v1::DType dtype, v1::PushMode mode,
                                           const std::string& data,
                                           std::optional<uint64_t> expected_version) {
  LOSSHEAD_ASSIGN_OR_RETURN(const kernels::DType src_dtype, FloatDType(dtype, "dtype"));
  if (mode != v1::PUSH_MODE_REPLACE && mode != v1::PUSH_MODE_ADD) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mode must be PUSH_MODE_REPLACE or PUSH_MODE_ADD, got ", static_cast<int>(mode)));
  }
  const size_t count = static_cast<size_t>(vocab_size()) * hidden_size();
  const size_t src_size = kernels::DTypeSize(src_dtype);
  if (data.size() != tensor_elements() * src_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pushed weights have ", data.size(), " bytes; ", vocab_size(), " x ", hidden_size(),
        has_bias() ? absl::StrCat(" + ", vocab_size(), " (the output bias)") : "", " x ",
        kernels::DTypeName(src_dtype), " needs ", tensor_elements() * src_size));
  }
  if (kernels::HasNonFinite(src_dtype, data.data(), tensor_elements())) {
    return absl::InvalidArgumentError(has_bias() ? "pushed weights or bias contain NaN or Inf"
                                                 : "pushed weights contain NaN or Inf");
  }
  // The bias part, fp32 (b = it, or b + it once the cut is held).
  const std::vector<float> pushed_bias =
      has_bias() ? BiasToFloat(src_dtype, data.data() + count * src_size,
                               static_cast<size_t>(vocab_size()))
                 : std::vector<float>();
  const size_t esize = kernels::DTypeSize(dtype_);
  std::string staged;
  absl::Cleanup recycle = [&staged] { GiveTransferBuffer(std::move(staged)); };
  // A replacement in the head's own dtype goes to the device from `data` as it is (checked
  // above); any other is converted, then checked for overflow.
  const bool in_place = mode == v1::PUSH_MODE_REPLACE && src_dtype == dtype_;
  if (mode == v1::PUSH_MODE_REPLACE && !in_place) {
    staged = ConvertOnHost(src_dtype, absl::string_view(data).substr(0, count * src_size), dtype_);
    if (kernels::HasNonFinite(dtype_, staged.data(), count)) {
      return absl::InvalidArgumentError(
          absl::StrCat("pushed weights overflow the head's dtype ", kernels::DTypeName(dtype_)));
    }
  }
  // W is replaced on replica 0 and copied from there to the others, so that replicas never
  // differ, by rounding or otherwise; each shard takes its rows.
  ReplicaGroup::Cut cut(group());
  {
    absl::MutexLock state(&state_mu_);
    if (expected_version.has_value() && *expected_version != version_) {
      return absl::FailedPreconditionError(
          absl::StrCat("expected_weights_version is ", *expected_version,
                       " but the head's weights are at version ", version_));
    }
  }
  if (mode == v1::PUSH_MODE_ADD) {
    staged = TakeTransferBuffer(count * esize);  // overwritten whole by the copy below
    LOSSHEAD_RETURN_IF_ERROR(placement_->CopyWeightsOut(staged.data()));
    LOSSHEAD_RETURN_IF_ERROR(group().Synchronize());
    // Sharded across processes: the other processes' rows too, so that every process decides
    // on the whole of W + delta alike (every process runs this push at once).
    LOSSHEAD_RETURN_IF_ERROR(GatherOtherRows(staged, esize));
    std::vector<float> w(std::min(count, kConvertBlock));
    std::vector<float> delta(w.size());
    for (size_t i = 0; i < count; i += kConvertBlock) {
      const size_t n = std::min(kConvertBlock, count - i);
      kernels::ToFloat(dtype_, staged.data() + i * esize, w.data(), n);
      kernels::ToFloat(src_dtype, data.data() + i * kernels::DTypeSize(src_dtype), delta.data(), n);
      for (size_t j = 0; j < n; ++j) w[j] += delta[j];
      kernels::FromFloat(dtype_, w.data(), staged.data() + i * esize, n);
    }
    if (kernels::HasNonFinite(dtype_, staged.data(), count)) {
      return absl::InvalidArgumentError("W + pushed delta overflows to Inf");
    }
  }
  std::vector<float> new_bias = pushed_bias;
  if (has_bias() && mode == v1::PUSH_MODE_ADD) {
    for (size_t j = 0; j < new_bias.size(); ++j) new_bias[j] += bias_.values[j];
    for (float b : new_bias) {
      if (!std::isfinite(b)) return absl::InvalidArgumentError("b + pushed delta overflows to Inf");
    }
  }
  const std::string& source = in_place ? data : staged;
  // The new W's magnitude bounds the micro-batches that run against it (ReserveStepBounds).
  const float pushed_abs = kernels::MaxAbs(dtype_, source.data(), count);
  LOSSHEAD_RETURN_IF_ERROR(
      placement_->CopyIn(&Replica::weights, esize, source.data(), 0, static_cast<int64_t>(count)));
  LOSSHEAD_RETURN_IF_ERROR(placement_->BroadcastWeights());
  LOSSHEAD_RETURN_IF_ERROR(group().Synchronize());
  if (has_bias()) {
    bias_.values = std::move(new_bias);
    LOSSHEAD_RETURN_IF_ERROR(CopyBiasIn(group(), bias_.values));
  }
  absl::MutexLock state(&state_mu_);
  weight_abs_ = pushed_abs;
  weight_abs_exact_ = true;
  return ++version_;
}

absl::StatusOr<WeightsSnapshot> Head::DownloadWeights(v1::DType dtype) {
  kernels::DType to = dtype_;
  if (dtype != v1::DTYPE_UNSPECIFIED) {
    LOSSHEAD_ASSIGN_OR_RETURN(to, FloatDType(dtype, "dtype"));
  }
  WeightsSnapshot snap;
  snap.dtype = ToProto(to);
  const size_t count = static_cast<size_t>(vocab_size()) * hidden_size();
  snap.data = TakeTransferBuffer(count * kernels::DTypeSize(dtype_));
  snap.bias = has_bias();
  std::vector<float> bias;
  {
    // Only a cut (a push, an optimizer apply) writes W, and it takes the locks of the devices
    // that hold W (WeightHolders: replica 0 of a replicated head, every shard): holding those
    // keeps the cuts out while the other replicas may go on running micro-batches.
    const ReplicaGroup::DeviceLocks holders(placement_->WeightHolders());
    LOSSHEAD_RETURN_IF_ERROR(placement_->CopyWeightsOut(snap.data.data()));
    LOSSHEAD_RETURN_IF_ERROR(placement_->SynchronizeHolders());
    // Sharded across processes, every process downloads at once (the leader's order).
    LOSSHEAD_RETURN_IF_ERROR(GatherOtherRows(snap.data, kernels::DTypeSize(dtype_)));
    // b is written only under the cut, which takes these locks too.
    bias = bias_.values;
    absl::MutexLock state(&state_mu_);
    snap.version = version_;
  }
  if (to != dtype_) {
    std::string raw = std::move(snap.data);
    snap.data = ConvertOnHost(dtype_, raw, to);
    GiveTransferBuffer(std::move(raw));
  }
  if (snap.bias) {
    // b after W, in the same dtype.
    const size_t at = snap.data.size();
    snap.data.resize(at + bias.size() * kernels::DTypeSize(to));
    kernels::FromFloat(to, bias.data(), snap.data.data() + at, bias.size());
  }
  return snap;
}

}  // namespace losshead::server
