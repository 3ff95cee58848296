// One direction of a process group connection, sealed (process_group.h, "encrypt"): the bytes of
// every exchange go as AES-256-GCM records of at most kMeshRecordBytes of plaintext, each followed
// by its 16-byte tag. The key is this direction's own (group_auth.h derives both from the group
// secret and the connection's fresh nonces); the 96-bit nonce is the record's number on the
// connection, counted from 0 by both ends, so that a record replayed, dropped, reordered or
// altered in transit fails its tag. Nothing else goes on the wire: both ends know every
// exchange's byte counts (the callers' protocol), hence every record's length.
//
// Invariants: a nonce is never used twice under one key (the counter only grows; 2^64 records of
// up to 1 MiB are out of any connection's reach). Open decrypts in place and zeroes what it wrote
// when the tag fails, so no unauthenticated byte stays. Not thread-safe: the group's exchanges are
// serialised.
#ifndef LOSSHEAD_KERNELS_COLLECTIVE_MESH_CIPHER_H_
#define LOSSHEAD_KERNELS_COLLECTIVE_MESH_CIPHER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"

namespace losshead::kernels {

inline constexpr size_t kMeshKeyBytes = 32;
inline constexpr size_t kMeshTagBytes = 16;
inline constexpr size_t kMeshRecordBytes = size_t{1} << 20;  // plaintext per record, at most

using MeshKey = std::array<std::byte, kMeshKeyBytes>;

// The record that carries plaintext bytes [done, done + n) of an exchange of `total`: n.
inline size_t MeshRecordPlainBytes(size_t total, size_t done) {
  return total - done < kMeshRecordBytes ? total - done : kMeshRecordBytes;
}

class MeshCipher {
 public:
  explicit MeshCipher(const MeshKey& key);
  ~MeshCipher();
  MeshCipher(const MeshCipher&) = delete;
  MeshCipher& operator=(const MeshCipher&) = delete;

  // `plain` (at most kMeshRecordBytes) sealed into `record` (plain.size() + kMeshTagBytes), as
  // the next record of this direction.
  absl::Status Seal(std::span<const std::byte> plain, std::span<std::byte> record);
  // The next record of this direction opened into `plain` (record.size() - kMeshTagBytes):
  // UNAUTHENTICATED, `plain` zeroed, when its tag does not check (altered, replayed, out of
  // order, or sealed under another key).
  absl::Status Open(std::span<const std::byte> record, std::span<std::byte> plain);

 private:
  std::array<unsigned char, 12> NextNonce();
  MeshKey key_;
  uint64_t records_ = 0;
  struct Context;
  std::unique_ptr<Context> ctx_;
};

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_COLLECTIVE_MESH_CIPHER_H_
