// Calls back when a file changes (its inode, size or modification time), checked every interval
// on a thread of its own. The token file is watched this way so that a file renamed into place,
// or a Kubernetes Secret volume (which swaps a symlink), takes effect without a signal.
#ifndef LOSSHEAD_SERVER_SECURITY_FILE_WATCHER_H_
#define LOSSHEAD_SERVER_SECURITY_FILE_WATCHER_H_

#include <sys/types.h>

#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace losshead::server {

// What identifies one version of a file; a missing file has ok == false.
struct FileStamp {
  bool ok = false;
  ino_t inode = 0;
  off_t size = 0;
  timespec modified{};
  bool operator==(const FileStamp& other) const;
};

// stat(2) of `path`, following symlinks.
FileStamp StampOf(const std::string& path);

class FileWatcher {
 public:
  // `since` is the version the caller already has (take it before reading the file, so that a
  // change in between is not missed). `on_change` runs on the watcher's thread, once per change
  // seen; a file that goes missing counts as a change too.
  FileWatcher(std::string path, FileStamp since, absl::Duration interval,
              std::function<void()> on_change);
  ~FileWatcher();  // stops and joins the thread

 private:
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_SECURITY_FILE_WATCHER_H_
