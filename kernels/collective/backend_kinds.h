// What the collective factories check first of the backends they are given, in one place.
#ifndef LOSSHEAD_KERNELS_COLLECTIVE_BACKEND_KINDS_H_
#define LOSSHEAD_KERNELS_COLLECTIVE_BACKEND_KINDS_H_

#include <span>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "losshead/kernels/backend.h"

namespace losshead::kernels {

struct BackendKinds {
  int cpu = 0;
  int cuda = 0;
};

// How many of `backends` are cpu and cuda backends. INVALID_ARGUMENT, the message starting with
// `call` (the factory's name), for no backends, a null one, or one of a kind that has no
// collective implementation. Mixing kinds is the caller's to refuse: its message says more.
absl::StatusOr<BackendKinds> CountBackendKinds(absl::string_view call,
                                               std::span<Backend* const> backends);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_COLLECTIVE_BACKEND_KINDS_H_
