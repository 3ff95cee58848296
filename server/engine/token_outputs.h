// The per-token outputs of the predicted distribution a micro-batch may ask for
// (v1::StepOptions.token_outputs) and its token accuracy (return_correct_count): which were asked,
// validated at the edge. Each per-token output is N values of 4 bytes (fp32, argmax int32), laid
// out one after another in TokenOutput order wherever they travel together (the I/O slot's
// buffer, the staged copy).
#ifndef LOSSHEAD_SERVER_ENGINE_TOKEN_OUTPUTS_H_
#define LOSSHEAD_SERVER_ENGINE_TOKEN_OUTPUTS_H_

#include <array>
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::server {

// In the order their buffers are laid out (and their StepResponse fields numbered).
enum class TokenOutput { kLogprob = 0, kEntropy = 1, kLse = 2, kArgmax = 3 };
inline constexpr int kTokenOutputs = 4;
inline constexpr size_t kTokenOutputBytes = 4;  // per token: fp32, or int32 for the argmax

struct TokenOutputs {
  std::array<bool, kTokenOutputs> per_token{};
  bool correct_count = false;

  bool asks(TokenOutput output) const { return per_token[static_cast<int>(output)]; }
  // Per-token outputs asked, and the slot each takes in the laid-out buffer (asked ones only).
  int count() const;
  int slot(TokenOutput output) const;
  // Anything beyond LSE (which every placement computes).
  bool distribution() const {
    return correct_count || asks(TokenOutput::kLogprob) || asks(TokenOutput::kEntropy) ||
           asks(TokenOutput::kArgmax);
  }
};

// The outputs `options` asks for; INVALID_ARGUMENT naming an unknown, unspecified or repeated
// value of token_outputs.
absl::StatusOr<TokenOutputs> ParseTokenOutputs(const v1::StepOptions& options);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_TOKEN_OUTPUTS_H_
