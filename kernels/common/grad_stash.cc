// What every backend checks of a gradient stash, and the default of a backend without one.
#include "losshead/kernels/grad_stash.h"

#include "absl/strings/str_cat.h"
#include "losshead/kernels/backend.h"

namespace losshead::kernels {

absl::Status ValidateGradStash(const GradStash& stash, int64_t n) {
  if (stash.data == nullptr || stash.capacity < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad_stash needs memory and a capacity >= 1, got capacity ", stash.capacity));
  }
  if (stash.tokens < 0 || n < 0 || stash.tokens > stash.capacity - n) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad_stash rows [", stash.tokens, ", ", stash.tokens + n,
                     ") do not fit its capacity of ", stash.capacity, " tokens"));
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> Backend::GradStashBytes(const Problem&, int64_t) const {
  return absl::UnimplementedError(absl::StrCat("the ", name(), " backend has no gradient stash"));
}

absl::Status Backend::FlushGradStash(const Problem&, const GradStash&, float*, void*, size_t,
                                     Stream&) {
  return absl::UnimplementedError(absl::StrCat("the ", name(), " backend has no gradient stash"));
}

}  // namespace losshead::kernels
