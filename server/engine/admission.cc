#include "server/engine/admission.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "losshead/kernels/problem.h"
#include "losshead/v1/wire_dtype.h"
#include "server/engine/proto_convert.h"

namespace losshead::server {
namespace {

constexpr absl::string_view kRetryAfterPayload = "type.losshead.dev/retry_after_ms";

}  // namespace

bool Admission::TryAdmit(size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (microbatches_ + 1 > max_microbatches_ || bytes > max_bytes_ - bytes_) return false;
  ++microbatches_;
  bytes_ += bytes;
  return true;
}

bool Admission::TryReserve(size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (bytes > max_bytes_ - bytes_) return false;
  bytes_ += bytes;
  return true;
}

void Admission::Release(size_t microbatches, size_t bytes) {
  absl::MutexLock lock(&mu_);
  microbatches_ -= std::min(microbatches, microbatches_);
  bytes_ -= std::min(bytes, bytes_);
}

void Admission::Replace(size_t from, size_t to) {
  absl::MutexLock lock(&mu_);
  bytes_ -= std::min(from, bytes_);
  bytes_ += to;
}

size_t Admission::microbatches() const {
  absl::MutexLock lock(&mu_);
  return microbatches_;
}

size_t Admission::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

absl::Status Admission::Refusal(absl::string_view what) const {
  const int64_t ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(retry_after_));
  absl::Status status = absl::ResourceExhaustedError(
      absl::StrCat("server busy: ", what, " (--max_inflight_microbatches ", max_microbatches_,
                   ", --max_inflight_bytes ", max_bytes_, "); retry after ", ms, " ms"));
  status.SetPayload(kRetryAfterPayload, absl::Cord(absl::StrCat(ms)));
  return status;
}

uint64_t AnnouncedBytes(const v1::StepHeader& header, int64_t hidden_size) {
  const size_t h = v1::WireDTypeSize(header.hidden_dtype());
  const size_t t = v1::WireDTypeSize(header.target_dtype());
  if (header.num_tokens() <= 0 || hidden_size <= 0 || h == 0 || t == 0) return 0;
  // 4 bytes per token for each per-token input named (a repeated or bad one counted too: it is
  // refused anyway).
  const size_t inputs = 4 * static_cast<size_t>(header.token_inputs_size());
  const unsigned __int128 total = static_cast<unsigned __int128>(header.num_tokens()) *
                                  (static_cast<unsigned __int128>(hidden_size) * h + t + inputs);
  return total > std::numeric_limits<uint64_t>::max() ? std::numeric_limits<uint64_t>::max()
                                                      : static_cast<uint64_t>(total);
}

uint64_t AnswerBytes(const v1::StepHeader& header, int64_t hidden_size) {
  // An embedding gradient is answered by its result alone.
  if (header.kind() == v1::STEP_KIND_EMBEDDING_GRAD) return 0;
  const v1::StepOptions& options = header.options();
  const v1::DType grad = options.grad_hidden_dtype() != v1::DTYPE_UNSPECIFIED
                             ? options.grad_hidden_dtype()
                             : header.hidden_dtype();
  const size_t g = options.skip_grad_hidden() ? 0 : v1::WireDTypeSize(grad);
  if (header.num_tokens() <= 0 || hidden_size <= 0) return 0;
  // 4 bytes per token for the per-token losses and for each token output asked (a repeated or
  // bad one counted too: it is refused anyway).
  const size_t per_token = 4 * (1 + static_cast<size_t>(options.token_outputs_size()));
  // And 8 bytes per token and top-k entry (an id and a log-prob); a top_k beyond the limit is
  // refused anyway, so it counts as the limit (and not as a size to refuse room for).
  const size_t top_k_bytes =
      8 * static_cast<size_t>(std::min<uint32_t>(options.top_k(), kernels::kMaxTopK));
  const unsigned __int128 total =
      static_cast<unsigned __int128>(header.num_tokens()) *
      (static_cast<unsigned __int128>(hidden_size) * g + per_token + top_k_bytes);
  return total > std::numeric_limits<uint64_t>::max() ? std::numeric_limits<uint64_t>::max()
                                                      : static_cast<uint64_t>(total);
}

uint32_t RetryAfterMs(const absl::Status& status) {
  auto payload = status.GetPayload(kRetryAfterPayload);
  uint32_t ms = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &ms)) return 0;
  return ms;
}

}  // namespace losshead::server
