#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/embedding_rows.h"
#include "server/engine/proto_convert.h"

namespace losshead::server {

absl::StatusOr<std::vector<int64_t>> ParseRowIds(v1::DType id_dtype, absl::string_view ids,
                                                 int64_t vocab_size, int64_t expected) {
  size_t width;
  if (id_dtype == v1::DTYPE_INT32) {
    width = 4;
  } else if (id_dtype == v1::DTYPE_INT64) {
    width = 8;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("ids must be DTYPE_INT32 or DTYPE_INT64, got ", static_cast<int>(id_dtype)));
  }
  if (ids.size() % width != 0 ||
      (expected >= 0 && ids.size() != static_cast<size_t>(expected) * width)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ids are ", ids.size(), " bytes, ",
                     expected >= 0 ? absl::StrCat("expected ", expected * width, " (", expected,
                                                  " ids of ", width, " bytes)")
                                   : absl::StrCat("not a whole number of ", width, "-byte ids")));
  }
  std::vector<int64_t> out(ids.size() / width);
  for (size_t i = 0; i < out.size(); ++i) {
    if (width == 4) {
      int32_t v;
      std::memcpy(&v, ids.data() + i * 4, 4);
      out[i] = v;
    } else {
      std::memcpy(&out[i], ids.data() + i * 8, 8);
    }
    if (out[i] < 0 || out[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "id ", out[i], " at position ", i, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return out;
}

absl::Status CheckEmbeddingGradHeader(const v1::StepHeader& h) {
  if (h.num_tokens() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens (rows of dE) must be >= 1, got ", h.num_tokens()));
  }
  LOSSHEAD_RETURN_IF_ERROR(FloatDType(h.hidden_dtype(), "hidden_dtype").status());
  if (h.target_dtype() != v1::DTYPE_INT32 && h.target_dtype() != v1::DTYPE_INT64) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_dtype (of the ids) must be DTYPE_INT32 or DTYPE_INT64, got ",
                     static_cast<int>(h.target_dtype())));
  }
  const v1::StepOptions& o = h.options();
  const char* set = nullptr;
  if (o.has_grad_scale())
    set = "options.grad_scale";
  else if (o.reduction() != v1::REDUCTION_UNSPECIFIED)
    set = "options.reduction";
  else if (o.return_per_token_loss())
    set = "options.return_per_token_loss";
  else if (o.skip_grad_hidden())
    set = "options.skip_grad_hidden";
  else if (o.grad_hidden_dtype() != v1::DTYPE_UNSPECIFIED)
    set = "options.grad_hidden_dtype";
  else if (o.forward_only())
    set = "options.forward_only";
  else if (o.top_k() != 0)
    set = "options.top_k";
  else if (h.loss_options().ByteSizeLong() != 0)
    set = "loss_options";
  else if (h.token_inputs_size() != 0)
    set = "token_inputs";
  if (set != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(set,
                     " is a loss's option; an EMBEDDING_GRAD micro-batch carries none (only "
                     "options.expected_weights_version)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PreparedEmbeddingGrad> PrepareEmbeddingGrad(const MicroBatch& mb, int64_t vocab_size,
                                                           int64_t hidden_size) {
  const v1::StepHeader& h = mb.header;
  LOSSHEAD_RETURN_IF_ERROR(CheckEmbeddingGradHeader(h));
  for (int i = 0; i < kTokenInputs; ++i) {
    if (mb.token_inputs[i].empty()) continue;
    return absl::InvalidArgumentError(
        absl::StrCat(TokenInputField(static_cast<TokenInput>(i)),
                     " is a loss's input; an EMBEDDING_GRAD micro-batch carries none"));
  }
  LOSSHEAD_ASSIGN_OR_RETURN(const kernels::DType dtype,
                            FloatDType(h.hidden_dtype(), "hidden_dtype"));
  const int64_t n = h.num_tokens();
  const absl::string_view rows = mb.hidden_bytes();
  const size_t want = static_cast<size_t>(n) * hidden_size * kernels::DTypeSize(dtype);
  if (rows.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat("dE is ", rows.size(), " bytes, expected ", want,
                                                   " (", n, " x ", hidden_size, " ",
                                                   kernels::DTypeName(dtype), ")"));
  }
  LOSSHEAD_ASSIGN_OR_RETURN(std::vector<int64_t> ids,
                            ParseRowIds(h.target_dtype(), mb.targets, vocab_size, n));
  std::vector<float> values(static_cast<size_t>(n) * hidden_size);
  kernels::ToFloat(dtype, rows.data(), values.data(), values.size());
  const float max_abs = kernels::MaxAbs(kernels::DType::kFP32, values.data(), values.size());
  if (!std::isfinite(max_abs)) {
    return absl::InvalidArgumentError("dE holds a NaN or an Inf; nothing was added to dW");
  }
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&ids](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  PreparedEmbeddingGrad p;
  p.max_abs = max_abs;
  p.ids.resize(n);
  p.values.resize(values.size());
  int64_t run = 0;
  for (int64_t i = 0; i < n; ++i) {
    p.ids[i] = ids[order[i]];
    std::memcpy(p.values.data() + i * hidden_size, values.data() + order[i] * hidden_size,
                hidden_size * sizeof(float));
    run = (i > 0 && p.ids[i] == p.ids[i - 1]) ? run + 1 : 1;
    p.max_repeats = std::max(p.max_repeats, run);
  }
  return p;
}

}  // namespace losshead::server
