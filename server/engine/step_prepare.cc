#include "server/engine/step_prepare.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/v1/wire_dtype.h"
#include "server/engine/host_tensors.h"
#include "server/engine/proto_convert.h"

namespace losshead::server {
namespace {

// `value` as `dtype` holds it (round to nearest even), back in fp32.
float RoundToDType(float value, kernels::DType dtype) {
  char bytes[sizeof(float)];
  kernels::FromFloat(dtype, &value, bytes, 1);
  float rounded = 0;
  kernels::ToFloat(dtype, bytes, &rounded, 1);
  return rounded;
}

}  // namespace

absl::Status PrepareHeader(const v1::StepHeader& h, const StepTarget& head,
                           const v1::LossOptions& defaults, PreparedStep* prepared) {
  PreparedStep& p = *prepared;
  if (h.num_tokens() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens must be >= 1, got ", h.num_tokens()));
  }
  LOSSHEAD_ASSIGN_OR_RETURN(p.hidden_dtype, FloatDType(h.hidden_dtype(), "hidden_dtype"));
  if (h.target_dtype() != v1::DTYPE_INT32 && h.target_dtype() != v1::DTYPE_INT64) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_dtype must be DTYPE_INT32 or DTYPE_INT64, got ",
                     static_cast<int>(h.target_dtype())));
  }
  p.want_grad_hidden = !h.options().skip_grad_hidden();
  if (h.options().grad_hidden_dtype() == v1::DTYPE_UNSPECIFIED) {
    p.grad_hidden_dtype = p.hidden_dtype;
  } else {
    LOSSHEAD_ASSIGN_OR_RETURN(p.grad_hidden_dtype, FloatDType(h.options().grad_hidden_dtype(),
                                                              "options.grad_hidden_dtype"));
  }
  LOSSHEAD_ASSIGN_OR_RETURN(p.outputs, ParseTokenOutputs(h.options()));
  LOSSHEAD_ASSIGN_OR_RETURN(p.outputs.top_k, ParseTopK(h.options(), head.vocab_size));
  LOSSHEAD_ASSIGN_OR_RETURN(kernels::LossOptions loss,
                            ResolveLossOptions(h.loss_options(), defaults, &h.options()));
  p.want_per_token =
      h.options().return_per_token_loss() || loss.reduction == kernels::Reduction::kNone;
  // Targets are int32 for the kernels. An ignore_index beyond int32 is mapped to INT32_MIN, which
  // no valid target can equal.
  p.ignore_index = loss.ignore_index;
  const bool ignore_fits = p.ignore_index >= std::numeric_limits<int32_t>::min() &&
                           p.ignore_index <= std::numeric_limits<int32_t>::max();
  loss.ignore_index =
      ignore_fits ? static_cast<int32_t>(p.ignore_index) : std::numeric_limits<int32_t>::min();
  p.problem = kernels::Problem{.n = h.num_tokens(),
                               .d = head.hidden_size,
                               .v = head.vocab_size,
                               .dtype = head.dtype,
                               .options = loss,
                               .precision = head.precision};
  LOSSHEAD_RETURN_IF_ERROR(head.backend->CanImplement(p.problem));
  LOSSHEAD_ASSIGN_OR_RETURN(p.inputs.inputs, ParseTokenInputs(h));
  LOSSHEAD_RETURN_IF_ERROR(CheckTokenInputsFit(p.inputs.inputs, p.problem));
  if (h.options().has_expected_weights_version()) {
    p.expected_version = h.options().expected_weights_version();
  }
  p.forward_only = h.options().forward_only();
  return absl::OkStatus();
}

absl::StatusOr<PreparedStep> PrepareStep(const MicroBatch& mb, const StepTarget& head,
                                         const v1::LossOptions& defaults) {
  const v1::StepHeader& h = mb.header;
  PreparedStep p;
  LOSSHEAD_RETURN_IF_ERROR(PrepareHeader(h, head, defaults, &p));
  p.grad_hidden_to = mb.grad_hidden_to;
  p.grad_hidden_to_bytes = mb.grad_hidden_to_bytes;
  const uint64_t n = h.num_tokens();
  const uint64_t d = head.hidden_size;
  const size_t hsize = kernels::DTypeSize(p.hidden_dtype);
  const size_t tsize = v1::WireDTypeSize(h.target_dtype());
  const absl::string_view hidden = mb.hidden_bytes();
  // Compare sizes without overflowing n * d * size for absurd n. Hidden states elsewhere were
  // checked by their origin before it sent the micro-batch.
  if (!mb.hidden_elsewhere && (n > hidden.size() / (d * hsize) || n * d * hsize != hidden.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden has ", hidden.size(), " bytes; num_tokens x hidden_size x ",
                     kernels::DTypeName(p.hidden_dtype), " needs ", n, " x ", d, " x ", hsize));
  }
  if (n * tsize != mb.targets.size()) {
    return absl::InvalidArgumentError(absl::StrCat("targets has ", mb.targets.size(),
                                                   " bytes; num_tokens needs ", n, " x ", tsize));
  }
  const int64_t ignore = p.ignore_index;
  const int32_t ignore32 = p.problem.options.ignore_index;
  p.targets.resize(n);
  const int64_t v = head.vocab_size;
  for (uint64_t i = 0; i < n; ++i) {
    int64_t t;
    if (h.target_dtype() == v1::DTYPE_INT32) {
      int32_t t32;
      std::memcpy(&t32, mb.targets.data() + i * 4, 4);
      t = t32;
    } else {
      std::memcpy(&t, mb.targets.data() + i * 8, 8);
    }
    if (t == ignore) {
      p.targets[i] = ignore32;
      continue;
    }
    if (t < 0 || t >= v) {
      return absl::InvalidArgumentError(absl::StrCat("targets[", i, "] = ", t, " is outside [0, ",
                                                     v, ") and is not ignore_index ", ignore));
    }
    p.targets[i] = static_cast<int32_t>(t);
    ++p.counted_tokens;
  }

  LOSSHEAD_ASSIGN_OR_RETURN(p.inputs,
                            ReadTokenInputs(p.inputs.inputs, mb.token_inputs, p.targets, ignore32));
  const TokenInputBounds in = BoundTokenInputs(p.inputs, p.targets, ignore32);
  p.input_bounds = kernels::TermInputBounds{.weight_abs = in.weight_abs,
                                            .advantage_abs = in.advantage_abs,
                                            .old_logprob_neg = in.old_logprob_neg};

  // NaN policy: non-finite hidden states are rejected, never computed: they would poison dW for
  // every micro-batch accumulated with them until the next pull. The receiver checks as the
  // pieces arrive, while they are in cache; a direct caller's micro-batch is checked here.
  // Its magnitude, taken in the same pass, bounds what the run computes (ReserveStepBounds).
  if (mb.hidden_elsewhere) {
    if (!mb.hidden_max_abs.has_value()) {
      return absl::InternalError("hidden states sent from another process without their bound");
    }
    // Rounding is monotonic: the largest |h| in the head's dtype is the largest |h| rounded.
    p.hidden_elsewhere = true;
    p.hidden_abs = RoundToDType(*mb.hidden_max_abs, head.dtype);
    return p;
  }
  const float max_abs = mb.hidden_max_abs.has_value()
                            ? *mb.hidden_max_abs
                            : kernels::MaxAbs(p.hidden_dtype, hidden.data(), n * d);
  if (!std::isfinite(max_abs)) return absl::InvalidArgumentError("hidden contains NaN or Inf");
  p.hidden_abs = max_abs;
  if (p.hidden_dtype == head.dtype) {
    p.request_hidden = hidden;
    p.request_pinned = mb.pinned_hidden != nullptr;
  } else {
    p.converted = ConvertOnHost(p.hidden_dtype, hidden, head.dtype);
    const float converted_abs = kernels::MaxAbs(head.dtype, p.converted.data(), n * d);
    if (!std::isfinite(converted_abs)) {
      return absl::InvalidArgumentError(
          absl::StrCat("hidden overflows the head's dtype ", kernels::DTypeName(head.dtype)));
    }
    p.hidden_abs = converted_abs;
  }
  return p;
}

}  // namespace losshead::server
