#include "server/engine/token_inputs.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace losshead::server {

// TokenInput values 1..kTokenInputs index TokenInputs::present: a value added to the proto needs
// its place here (and in the layouts that follow this order) first.
static_assert(v1::TokenInput_MAX == kTokenInputs);
static_assert(v1::TOKEN_INPUT_WEIGHT == 1 + static_cast<int>(TokenInput::kWeight) &&
              v1::TOKEN_INPUT_OLD_LOGPROB == 1 + static_cast<int>(TokenInput::kOldLogprob) &&
              v1::TOKEN_INPUT_ADVANTAGE == 1 + static_cast<int>(TokenInput::kAdvantage) &&
              v1::TOKEN_INPUT_REF_LOGPROB == 1 + static_cast<int>(TokenInput::kRefLogprob));

absl::string_view TokenInputField(TokenInput input) {
  switch (input) {
    case TokenInput::kWeight:
      return "token_weights";
    case TokenInput::kOldLogprob:
      return "old_logprob";
    case TokenInput::kAdvantage:
      return "advantages";
    case TokenInput::kRefLogprob:
      return "ref_logprob";
  }
  return "";
}

int TokenInputs::count() const {
  int n = 0;
  for (bool b : present) n += b ? 1 : 0;
  return n;
}

int TokenInputs::slot(TokenInput input) const {
  int before = 0;
  for (int i = 0; i < static_cast<int>(input); ++i) before += present[i] ? 1 : 0;
  return before;
}

absl::StatusOr<TokenInputs> ParseTokenInputs(const v1::StepHeader& header) {
  TokenInputs out;
  for (int i = 0; i < header.token_inputs_size(); ++i) {
    const int value = header.token_inputs(i);
    // Proto3 keeps a number this build does not know as it came: name it by number.
    const std::string name = v1::TokenInput_IsValid(value)
                                 ? v1::TokenInput_Name(static_cast<v1::TokenInput>(value))
                                 : absl::StrCat(value);
    if (!v1::TokenInput_IsValid(value) || value == v1::TOKEN_INPUT_UNSPECIFIED) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_inputs[", i, "] = ", name,
                       " is not a token input (TOKEN_INPUT_WEIGHT, TOKEN_INPUT_OLD_LOGPROB, "
                       "TOKEN_INPUT_ADVANTAGE or TOKEN_INPUT_REF_LOGPROB)"));
    }
    bool& named = out.present[value - 1];
    if (named) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_inputs[", i, "] = ", name, " repeats an earlier entry"));
    }
    named = true;
  }
  return out;
}

absl::Status CheckTokenInputsFit(const TokenInputs& inputs, const kernels::Problem& problem) {
  // The kernels' own rule, on stand-in pointers: only presence matters to it.
  static const float kPresent = 0.0f;
  kernels::Arguments args;
  args.token_weights = inputs.has(TokenInput::kWeight) ? &kPresent : nullptr;
  args.old_logprob = inputs.has(TokenInput::kOldLogprob) ? &kPresent : nullptr;
  args.advantages = inputs.has(TokenInput::kAdvantage) ? &kPresent : nullptr;
  args.ref_logprob = inputs.has(TokenInput::kRefLogprob) ? &kPresent : nullptr;
  return kernels::ValidateLossInputs(problem, args);
}

absl::StatusOr<TokenInputValues> ReadTokenInputs(const TokenInputs& inputs,
                                                 const std::array<std::string, kTokenInputs>& bytes,
                                                 const std::vector<int32_t>& targets,
                                                 int32_t ignore_index) {
  const size_t n = targets.size();
  TokenInputValues out;
  out.inputs = inputs;
  out.values.resize(static_cast<size_t>(inputs.count()) * n);
  for (int i = 0; i < kTokenInputs; ++i) {
    const auto input = static_cast<TokenInput>(i);
    const std::string& got = bytes[i];
    if (!inputs.has(input)) {
      if (!got.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(TokenInputField(input), " has ", got.size(),
                         " bytes but the header's token_inputs does not name it"));
      }
      continue;
    }
    if (got.size() != n * kTokenInputBytes) {
      return absl::InvalidArgumentError(absl::StrCat(TokenInputField(input), " has ", got.size(),
                                                     " bytes; num_tokens needs ", n, " x 4"));
    }
    float* to = out.values.data() + static_cast<size_t>(inputs.slot(input)) * n;
    std::memcpy(to, got.data(), got.size());
    for (size_t t = 0; t < n; ++t) {
      if (targets[t] == ignore_index || std::isfinite(to[t])) continue;
      return absl::InvalidArgumentError(
          absl::StrCat(TokenInputField(input), "[", t, "] = ", to[t], " is not finite (token ", t,
                       " is counted); nothing was computed or counted"));
    }
  }
  return out;
}

TokenInputBounds BoundTokenInputs(const TokenInputValues& v, const std::vector<int32_t>& targets,
                                  int32_t ignore_index) {
  TokenInputBounds b;
  const int64_t n = static_cast<int64_t>(targets.size());
  const float* w = v.of(TokenInput::kWeight, n);
  const float* o = v.of(TokenInput::kOldLogprob, n);
  const float* a = v.of(TokenInput::kAdvantage, n);
  if (w != nullptr) b.weight_abs = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (targets[t] == ignore_index) continue;
    if (w != nullptr) b.weight_abs = std::max(b.weight_abs, std::abs(static_cast<double>(w[t])));
    if (a != nullptr) {
      b.advantage_abs = std::max(b.advantage_abs, std::abs(static_cast<double>(a[t])));
    }
    if (o != nullptr) b.old_logprob_neg = std::max(b.old_logprob_neg, -static_cast<double>(o[t]));
  }
  return b;
}

}  // namespace losshead::server
