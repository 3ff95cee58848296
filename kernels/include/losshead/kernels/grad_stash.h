// Deferred dW: a micro-batch answered after the logits and dH GEMMs, its part of dW added later.
//
// dW += G^T H reads and writes the whole fp32 accumulator however few tokens a call has, so a
// small micro-batch pays a full pass over V x D for little work. With a stash, Run leaves the
// micro-batch's logit gradient G (already scaled by its reduction and grad_scale, so that
// micro-batches of different scales share one GEMM) and its hidden states H in the stash's next
// rows, and FlushGradStash adds every stashed token to dW in one GEMM whose inner dimension is
// the stash's token count.
//
//   Run(problem, args with grad_stash = {data, capacity, tokens = t0})   G, H -> rows [t0, t0 + n)
//   ... more Runs, each at the rows after the last ...
//   FlushGradStash(problem, {data, capacity, tokens = t}, dW)          dW += G[0, t)^T H[0, t)
//
// The stash's layout and G's element type are the backend's (GradStashBytes); a stash is used by
// one backend and one head shape. See docs/deferred-dw.md for the server's use of it.
#ifndef LOSSHEAD_KERNELS_GRAD_STASH_H_
#define LOSSHEAD_KERNELS_GRAD_STASH_H_

#include <cstdint>

#include "absl/status/status.h"

namespace losshead::kernels {

struct GradStash {
  void* data = nullptr;  // Backend::GradStashBytes(problem, capacity) bytes of its memory
  int64_t capacity = 0;  // token rows it holds
  int64_t tokens = 0;    // Run: the micro-batch's first row; FlushGradStash: rows [0, tokens)
};

// INVALID_ARGUMENT unless `stash` has memory, 0 <= tokens and tokens + n <= capacity (n = the
// micro-batch's tokens for Run, 0 for a flush).
absl::Status ValidateGradStash(const GradStash& stash, int64_t n);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_GRAD_STASH_H_
