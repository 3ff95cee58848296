#include "server/security/file_watcher.h"

#include <sys/stat.h>

#include <utility>

namespace losshead::server {

bool FileStamp::operator==(const FileStamp& other) const {
  return ok == other.ok && inode == other.inode && size == other.size &&
         modified.tv_sec == other.modified.tv_sec && modified.tv_nsec == other.modified.tv_nsec;
}

FileStamp StampOf(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return FileStamp{};
  return FileStamp{.ok = true, .inode = st.st_ino, .size = st.st_size, .modified = st.st_mtim};
}

FileWatcher::FileWatcher(std::string path, FileStamp since, absl::Duration interval,
                         std::function<void()> on_change)
    : thread_([this, path = std::move(path), last = since, interval,
               on_change = std::move(on_change)]() mutable {
        while (!stop_.WaitForNotificationWithTimeout(interval)) {
          const FileStamp now = StampOf(path);
          if (now == last) continue;
          last = now;
          on_change();
        }
      }) {}

FileWatcher::~FileWatcher() {
  stop_.Notify();
  thread_.join();
}

}  // namespace losshead::server
