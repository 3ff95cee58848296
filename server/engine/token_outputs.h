// The per-token outputs of the predicted distribution a micro-batch may ask for
// (v1::StepOptions.token_outputs), its token accuracy (return_correct_count) and its top-k
// (top_k): which were asked, validated at the edge. Each per-token output is N values of 4 bytes
// (fp32, argmax int32), laid out one after another in TokenOutput order wherever they travel
// together (the I/O slot's buffer, the staged copy), then the top-k's ids (N x top_k int32) and
// log-probs (N x top_k fp32), each row-major.
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
  int32_t top_k = 0;  // 0: none; else in [1, min(kernels::kMaxTopK, V)] (ParseTopK)

  bool asks(TokenOutput output) const { return per_token[static_cast<int>(output)]; }
  // Per-token outputs asked, and the slot each takes in the laid-out buffer (asked ones only).
  int count() const;
  int slot(TokenOutput output) const;
  // Anything beyond LSE (which every placement computes without further statistics).
  bool distribution() const {
    return correct_count || top_k > 0 || asks(TokenOutput::kLogprob) ||
           asks(TokenOutput::kEntropy) || asks(TokenOutput::kArgmax);
  }
  // The laid-out buffer of `n` tokens: its bytes, and where the top-k's ids and log-probs start.
  size_t bytes(int64_t n) const {
    return static_cast<size_t>(count() + 2 * top_k) * n * kTokenOutputBytes;
  }
  size_t top_k_ids_offset(int64_t n) const {
    return static_cast<size_t>(count()) * n * kTokenOutputBytes;
  }
  size_t top_k_logprobs_offset(int64_t n) const {
    return static_cast<size_t>(count() + top_k) * n * kTokenOutputBytes;
  }
};

// The outputs `options` asks for; INVALID_ARGUMENT naming an unknown, unspecified or repeated
// value of token_outputs.
absl::StatusOr<TokenOutputs> ParseTokenOutputs(const v1::StepOptions& options);
// `options.top_k` checked against a head of `vocab_size` classes: INVALID_ARGUMENT above
// kernels::kMaxTopK or above the vocabulary.
absl::StatusOr<int32_t> ParseTopK(const v1::StepOptions& options, int64_t vocab_size);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_TOKEN_OUTPUTS_H_
