// POSIX file descriptors with absl::Status errors, for the files the project writes whole and reads
// back (checkpoints, snapshots, safetensors exports).
#ifndef LOSSHEAD_COMMON_POSIX_FILE_H_
#define LOSSHEAD_COMMON_POSIX_FILE_H_

#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace losshead {

// The errno of the call that just failed as a status naming `what` and `path`, with the reason:
// NOT_FOUND for ENOENT, INTERNAL otherwise.
absl::Status PosixError(absl::string_view what, const std::string& path);

// Owns a descriptor (-1: none) and closes it on destruction.
class UniqueFd {
 public:
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd();
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  // Closes it now: close() reports deferred write errors on some file systems, so a file written
  // whole is closed through this and its status checked.
  absl::Status Close(const std::string& path);

 private:
  int fd_;
};

// Writes all of `data` to `fd`, through short writes and EINTR.
absl::Status WriteAll(int fd, absl::string_view data, const std::string& path);

// Writes `pieces` in order to `path` + ".tmp", fsyncs and closes it, then renames it onto
// `path`: a reader sees the old file or the whole new one, never part of it. On error the
// temporary file is removed and `path` is as it was. The directory is fsynced last, so that the
// rename survives a crash too.
absl::Status WriteFileAtomically(const std::string& path,
                                 std::span<const absl::string_view> pieces);

// fsync of directory `dir`: an entry made in it (a file renamed into it, a directory created in
// it) survives a crash only once this returns OK.
absl::Status SyncDirectory(const std::string& dir);

}  // namespace losshead

#endif  // LOSSHEAD_COMMON_POSIX_FILE_H_
