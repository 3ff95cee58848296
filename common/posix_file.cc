#include "common/posix_file.h"

#include <fcntl.h>
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

namespace {

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path,
                                 std::span<const absl::string_view> pieces) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) return PosixError("cannot create", tmp);
    absl::Status s;
    for (absl::string_view piece : pieces) {
      if (s.ok()) s = WriteAll(fd.get(), piece, tmp);
    }
    // The data must be on disk before the rename makes it the file.
    if (s.ok() && ::fsync(fd.get()) != 0) s = PosixError("cannot fsync", tmp);
    if (s.ok()) s = fd.Close(tmp);
    if (!s.ok()) {
      ::unlink(tmp.c_str());
      return s;
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status s = PosixError("cannot rename onto", path);
    ::unlink(tmp.c_str());
    return s;
  }
  // The rename itself is durable only once the directory entry is.
  return SyncDirectory(DirOf(path));
}

absl::Status SyncDirectory(const std::string& dir) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return PosixError("cannot open directory", dir);
  if (::fsync(fd.get()) != 0) return PosixError("cannot fsync directory", dir);
  return absl::OkStatus();
}

}  // namespace losshead
