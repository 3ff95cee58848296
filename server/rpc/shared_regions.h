// Shared memory regions registered by clients on the server's host (docs/same-node.md): each a
// client's memfd mapped here (a host region) or a client's CUDA allocation opened through its IPC
// handle (a device region, device_ipc.h), known by an id and a random key, bound to the bearer
// token that registered it. Free of gRPC; the socket that registers them is same_node_listener.h.
//
// Invariants:
// - A region is mapped only if its memfd is sealed against shrinking (F_SEAL_SHRINK), so that
//   no access inside its registered size can fault: a client cannot make the server crash by
//   truncating the file it shared.
// - Resolve hands out a region only to a caller presenting its key and the identity that
//   registered it; every refusal changes nothing.
// - Unregister removes a region from the table at once; its mapping stays until the last
//   micro-batch that resolved it lets it go (a shared_ptr), then it is unmapped. mapped_bytes()
//   counts mappings that exist, so it returns to 0 once every region's client is gone. A device
//   region's handle is closed the same way (DeviceMapping's destructor). registered() turns false
//   at Unregister and never back: a micro-batch that resolved a region checks it before it copies
//   a device region's tensors out (region_input.h).
#ifndef LOSSHEAD_SERVER_RPC_SHARED_REGIONS_H_
#define LOSSHEAD_SERVER_RPC_SHARED_REGIONS_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/rpc/device_ipc.h"

namespace losshead::server {

inline constexpr size_t kRegionKeyBytes = 16;

class SharedRegion {
 public:
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  uint64_t id() const { return id_; }
  const std::array<uint8_t, kRegionKeyBytes>& key() const { return key_; }
  size_t size() const { return size_; }
  // A host region's memory; null for a device region (reached through device()).
  uint8_t* data() const { return base_; }
  // A device region's mapping; null for a host region.
  const DeviceMapping* device() const { return device_.get(); }
  // OK when [offset, offset + bytes) lies inside the region; OUT_OF_RANGE naming `what`.
  absl::Status CheckRange(absl::string_view what, uint64_t offset, uint64_t bytes) const;
  // False once its client unregistered it (its connection closed), while the mapping lives on.
  bool registered() const { return registered_.load(std::memory_order_acquire); }

 private:
  friend class SharedRegions;
  struct Counters {
    std::atomic<size_t> regions{0};
    std::atomic<size_t> bytes{0};
  };
  SharedRegion() = default;

  uint64_t id_ = 0;
  std::array<uint8_t, kRegionKeyBytes> key_{};
  std::string principal_;  // who registered it: a digest of its bearer token ("" without tokens)
  uint8_t* base_ = nullptr;
  std::unique_ptr<DeviceMapping> device_;
  size_t size_ = 0;
  std::shared_ptr<Counters> counters_;
  std::atomic<bool> registered_{true};
};

class SharedRegions {
 public:
  // `devices`: where device regions are opened (DescribeIpcDevices of the server's CUDA devices);
  // empty: device regions are refused FAILED_PRECONDITION.
  explicit SharedRegions(std::vector<IpcDevice> devices = {})
      : devices_(std::move(devices)), counters_(std::make_shared<SharedRegion::Counters>()) {}

  // Maps `bytes` of the memfd `fd` (which the caller keeps and closes) for `principal`.
  // INVALID_ARGUMENT: not a regular file, `bytes` 0 or more than the file holds;
  // FAILED_PRECONDITION: not sealed against shrinking; RESOURCE_EXHAUSTED: mmap refused.
  absl::StatusOr<std::shared_ptr<SharedRegion>> Register(int fd, uint64_t bytes,
                                                         std::string principal);
  // Opens a client's device allocation (DeviceMapping::Open's arguments and refusals) for
  // `principal`.
  absl::StatusOr<std::shared_ptr<SharedRegion>> RegisterDevice(absl::string_view handle,
                                                               uint64_t offset, uint64_t bytes,
                                                               absl::string_view pci_bus_id,
                                                               std::string principal);
  void Unregister(uint64_t id);
  // The region `id` for a caller with `key` and `principal`: NOT_FOUND when no region has that
  // id, PERMISSION_DENIED when the key or the principal is not the registration's.
  absl::StatusOr<std::shared_ptr<SharedRegion>> Resolve(uint64_t id, absl::string_view key,
                                                        absl::string_view principal) const;

  const std::vector<IpcDevice>& devices() const { return devices_; }
  // Mappings that exist (registered, or unregistered and still used by a micro-batch).
  size_t mapped_regions() const { return counters_->regions.load(); }
  size_t mapped_bytes() const { return counters_->bytes.load(); }

 private:
  absl::StatusOr<std::shared_ptr<SharedRegion>> Add(std::unique_ptr<SharedRegion> region);

  const std::vector<IpcDevice> devices_;
  std::shared_ptr<SharedRegion::Counters> counters_;
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<SharedRegion>> regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_SHARED_REGIONS_H_
