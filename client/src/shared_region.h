// A shared memory region this client registered with a server on its host (docs/same-node.md):
// a sealed memfd mapped here and there, registered on the server's same-node socket. The server
// keeps it mapped for as long as this object's connection to that socket is open: destroying the
// object (or the process dying) unregisters it.
#ifndef LOSSHEAD_CLIENT_SRC_SHARED_REGION_H_
#define LOSSHEAD_CLIENT_SRC_SHARED_REGION_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "transport/fd_socket.h"

namespace losshead::client {

class SharedRegion {
 public:
  // Creates a region of at least `bytes` and registers it on `socket` with `authorization`
  // ("Bearer <token>" or empty). The server's refusal comes back with its code.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Register(const std::string& socket,
                                                                const std::string& authorization,
                                                                size_t bytes);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  std::byte* data() const { return base_; }
  size_t size() const { return size_; }
  uint64_t id() const { return id_; }
  const std::string& key() const { return key_; }

 private:
  SharedRegion() = default;
  std::byte* base_ = nullptr;
  size_t size_ = 0;
  uint64_t id_ = 0;
  std::string key_;
  transport::OwnedFd connection_;
};

}  // namespace losshead::client

#endif  // LOSSHEAD_CLIENT_SRC_SHARED_REGION_H_
