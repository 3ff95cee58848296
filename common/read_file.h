// Reading a whole small file (certificates, keys, token and password files) into memory.
#ifndef LOSSHEAD_COMMON_READ_FILE_H_
#define LOSSHEAD_COMMON_READ_FILE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace losshead {

// The bytes of the file at `path`. A file that cannot be opened or read is NOT_FOUND with the
// message "cannot read <what> '<path>'" (and the reason where known): `what` names the file as
// the user knows it, e.g. "--tls_cert".
absl::StatusOr<std::string> ReadFileToString(const std::string& path, absl::string_view what);

}  // namespace losshead

#endif  // LOSSHEAD_COMMON_READ_FILE_H_
