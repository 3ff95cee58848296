#include "server/engine/token_outputs.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "losshead/kernels/problem.h"

namespace losshead::server {

// TokenOutput values 1..kTokenOutputs index TokenOutputs::per_token: a value added to the proto
// needs its place here (and in the layouts that follow this order) first.
static_assert(v1::TokenOutput_MAX == kTokenOutputs);
static_assert(v1::TOKEN_OUTPUT_LOGPROB == 1 + static_cast<int>(TokenOutput::kLogprob) &&
              v1::TOKEN_OUTPUT_ENTROPY == 1 + static_cast<int>(TokenOutput::kEntropy) &&
              v1::TOKEN_OUTPUT_LSE == 1 + static_cast<int>(TokenOutput::kLse) &&
              v1::TOKEN_OUTPUT_ARGMAX == 1 + static_cast<int>(TokenOutput::kArgmax));

int TokenOutputs::count() const {
  int asked = 0;
  for (bool b : per_token) asked += b ? 1 : 0;
  return asked;
}

int TokenOutputs::slot(TokenOutput output) const {
  int before = 0;
  for (int i = 0; i < static_cast<int>(output); ++i) before += per_token[i] ? 1 : 0;
  return before;
}

absl::StatusOr<TokenOutputs> ParseTokenOutputs(const v1::StepOptions& options) {
  TokenOutputs out;
  out.correct_count = options.return_correct_count();
  for (int i = 0; i < options.token_outputs_size(); ++i) {
    const int value = options.token_outputs(i);
    // Proto3 keeps a number this build does not know as it came: name it by number.
    const std::string name = v1::TokenOutput_IsValid(value)
                                 ? v1::TokenOutput_Name(static_cast<v1::TokenOutput>(value))
                                 : absl::StrCat(value);
    if (!v1::TokenOutput_IsValid(value) || value == v1::TOKEN_OUTPUT_UNSPECIFIED) {
      return absl::InvalidArgumentError(
          absl::StrCat("options.token_outputs[", i, "] = ", name,
                       " is not a token output (TOKEN_OUTPUT_LOGPROB, TOKEN_OUTPUT_ENTROPY, "
                       "TOKEN_OUTPUT_LSE or TOKEN_OUTPUT_ARGMAX)"));
    }
    bool& asked = out.per_token[value - 1];
    if (asked) {
      return absl::InvalidArgumentError(
          absl::StrCat("options.token_outputs[", i, "] = ", name, " repeats an earlier entry"));
    }
    asked = true;
  }
  return out;
}

absl::StatusOr<int32_t> ParseTopK(const v1::StepOptions& options, int64_t vocab_size) {
  const uint32_t k = options.top_k();
  if (k > static_cast<uint32_t>(kernels::kMaxTopK) || k > vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.top_k must be in [0, ", kernels::kMaxTopK,
                     "] and at most the vocabulary (", vocab_size, "), got ", k));
  }
  return static_cast<int32_t>(k);
}

}  // namespace losshead::server
