// The per-token fp32 inputs of the loss terms a micro-batch may carry (v1::StepHeader.token_inputs:
// token weights, old log-probs, advantages, reference log-probs): which were named, validated at
// the edge, and their bytes as they came off the wire. Each is N fp32 values; wherever they travel
// together (the I/O slot's buffer) they lie one after another in TokenInput order, the ones not
// named left out.
#ifndef LOSSHEAD_SERVER_ENGINE_TOKEN_INPUTS_H_
#define LOSSHEAD_SERVER_ENGINE_TOKEN_INPUTS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "losshead/kernels/problem.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::server {

// In the order their buffers are laid out (and their StepRequest fields numbered, from 5).
enum class TokenInput { kWeight = 0, kOldLogprob = 1, kAdvantage = 2, kRefLogprob = 3 };
inline constexpr int kTokenInputs = 4;
inline constexpr size_t kTokenInputBytes = 4;  // per token: fp32

// The StepRequest field (and kernels::Arguments member) of each, by TokenInput.
absl::string_view TokenInputField(TokenInput input);

struct TokenInputs {
  std::array<bool, kTokenInputs> present{};

  bool has(TokenInput input) const { return present[static_cast<int>(input)]; }
  bool any() const { return count() > 0; }
  // Inputs present, and the slot each takes in the laid-out buffer (present ones only).
  int count() const;
  int slot(TokenInput input) const;
};

// The inputs `header` names; INVALID_ARGUMENT naming an unknown, unspecified or repeated value.
absl::StatusOr<TokenInputs> ParseTokenInputs(const v1::StepHeader& header);

// Which inputs go with which resolved options, as kernels::ValidateLossInputs says (old_logprob
// and advantages exactly with the policy-gradient kind, ref_logprob exactly when kl_coef > 0):
// INVALID_ARGUMENT naming the input.
absl::Status CheckTokenInputsFit(const TokenInputs& inputs, const kernels::Problem& problem);

// The inputs of one micro-batch, as fp32 host values, laid out as above (count() x N).
struct TokenInputValues {
  TokenInputs inputs;
  std::vector<float> values;
  const float* of(TokenInput input, int64_t n) const {
    return inputs.has(input) ? values.data() + static_cast<size_t>(inputs.slot(input)) * n
                             : nullptr;
  }
};

// The inputs' bytes (one string per TokenInput, as received) checked and laid out: each present
// one 4 N bytes (INVALID_ARGUMENT naming it otherwise), one not named empty (INVALID_ARGUMENT
// naming it: the header must name what is sent), and finite at every counted token, i.e. where
// `targets` is not `ignore_index` (INVALID_ARGUMENT naming the input and the token).
absl::StatusOr<TokenInputValues> ReadTokenInputs(const TokenInputs& inputs,
                                                 const std::array<std::string, kTokenInputs>& bytes,
                                                 const std::vector<int32_t>& targets,
                                                 int32_t ignore_index);

// The largest |value| of each present input over counted tokens (0 for absent ones), and the
// most negative old log-prob (as -min, >= 0 when any is negative, 0 otherwise): what the
// overflow guard bounds the terms by (the clamped KL term needs no bound of the reference's).
struct TokenInputBounds {
  double weight_abs = 1.0;  // 1 without weights
  double advantage_abs = 0;
  double old_logprob_neg = 0;  // max(0, -min_t o_t)
};
TokenInputBounds BoundTokenInputs(const TokenInputValues& values,
                                  const std::vector<int32_t>& targets, int32_t ignore_index);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_TOKEN_INPUTS_H_
