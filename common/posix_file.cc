#include "common/posix_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace losshead {

absl::Status PosixError(absl::string_view what, const std::string& path) {
  const int e = errno;
  const std::string text = absl::StrCat(what, " ", path, ": ", std::strerror(e));
  if (e == ENOENT) return absl::NotFoundError(text);
  return absl::InternalError(text);
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status UniqueFd::Close(const std::string& path) {
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return PosixError("cannot close", path);
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, absl::string_view data, const std::string& path) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("cannot write", path);
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

}  // namespace losshead
