#include "kernels/collective/backend_kinds.h"

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace losshead::kernels {

absl::StatusOr<BackendKinds> CountBackendKinds(absl::string_view call,
                                               std::span<Backend* const> backends) {
  if (backends.empty()) return absl::InvalidArgumentError(absl::StrCat(call, ": no backends"));
  BackendKinds kinds;
  for (size_t r = 0; r < backends.size(); ++r) {
    if (backends[r] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(call, ": backend of rank ", r, " is null"));
    }
    const absl::string_view name = backends[r]->name();
    if (name == "cpu") {
      ++kinds.cpu;
    } else if (name == "cuda") {
      ++kinds.cuda;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(call, ": backend of rank ", r, " is \"", name,
                                                     "\", which has no collective implementation"));
    }
  }
  return kinds;
}

}  // namespace losshead::kernels
