// The checkpoint of one head as a file: its spec, W, dW, counters and idempotency state.
//
// File layout (all integers little-endian), format version 3:
//   header (64 bytes): magic "LHCKPT\r\n", format version u32, reserved u32, meta bytes u64,
//     weights bytes u64, gradient bytes u64, checksum u64, optimizer bytes u64, optimizer piece
//     bytes u64
//   meta:      spec (serialized HeadSpec, default options and optimizer = the head's current
//              ones), version and counters, then per client id: max evicted / max applied
//              sequence and the remembered results (loss, token count, version, dH and
//              per-token-loss bytes, then a flags byte: 1 = a fingerprint follows (hidden and
//              target digests, header shape bytes), 2 = a remembered failure follows (status code
//              u32, message bytes)), then the optimizer record (checkpoint_optimizer.h: step
//              count, momentum bit, master version, buffer lengths, remembered applies with
//              their fingerprints)
//   weights:   W, V x D in the head's dtype
//   gradient:  dW, V x D fp32
//   optimizer: the master copy (BF16 and FP16 heads), then the state buffers, V x D fp32 each
// Format 6 adds the output bias record at the end of meta: a flags byte (1: the head has a bias,
// HeadSpec.bias) and then b, the window's db and b's optimizer state buffers, V fp32 each.
// Versions 1 to 5 are still read (a head without a bias).
// Format 7 adds the rows record after it: a flags byte (1: a checkpoint set's part of a head
// sharded across processes, HeadSpec.placement.across_processes) and then the group size, this
// process's rank, the shard count, its first global shard and its device count (u32 each), its
// first row and row count (u64 each); W, dW and the optimizer sections then hold those rows
// only. Versions 1 to 6 are still read (every row); they never hold such a head.
// Versions 1 and 2 are still read. Version 2 has no fingerprints or remembered failures (no flags
// byte per result, no fingerprint per apply): what it remembers replays unchecked. Version 1 has
// no optimizer either: its header has zeros for the optimizer lengths, its meta no optimizer
// record.
// The checksum covers the header's lengths and all the sections (Checksum below), so a torn or
// corrupted file is refused rather than half restored. Files are written atomically: a temporary
// file in the same directory, written and fsynced, renamed over the old one, then the directory is
// fsynced; a crash at any moment leaves either the old checkpoint or the new one.
#ifndef LOSSHEAD_SERVER_DURABILITY_CHECKPOINT_H_
#define LOSSHEAD_SERVER_DURABILITY_CHECKPOINT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/engine/head_checkpoint.h"

namespace losshead::server {

// Reads 6 (no rows record), 5 (no output bias record), 4 (no top-k in remembered results), 3 (no token outputs either), 2 (no fingerprints) and
// 1 (no optimizer either) too. Version 5 added the top-k: an older server refuses a file whose
// remembered results carry one rather than dropping it.
inline constexpr uint32_t kCheckpointFormatVersion = 7;
inline constexpr char kCheckpointSuffix[] = ".lhck";

// 64-bit checksum: four interleaved FNV-1a lanes over little-endian 8-byte words (lane i takes
// words i, i + 4, ...), trailing bytes into lane 0, lanes folded with FNV-1a. A change confined to
// one word always changes it; it runs at memory speed, unlike byte-wise FNV.
uint64_t Checksum(absl::string_view data, uint64_t seed = 0xcbf29ce484222325ULL);

// The file's bytes (tests and fuzzing; WriteCheckpointFile avoids this copy of W and dW).
std::string EncodeCheckpoint(const HeadCheckpointData& data);
// Parses and verifies a whole file image. DATA_LOSS names what is wrong (magic, version, lengths,
// checksum, meta fields); nothing is trusted before the checksum matches.
absl::StatusOr<HeadCheckpointData> DecodeCheckpoint(absl::string_view file);

// Atomic write (see above); returns the bytes written. Errors carry the path and errno text.
absl::StatusOr<uint64_t> WriteCheckpointFile(const std::string& path,
                                             const HeadCheckpointData& data);
// Reads and verifies `path`; errors (NOT_FOUND, DATA_LOSS, ...) name the file.
absl::StatusOr<HeadCheckpointData> ReadCheckpointFile(const std::string& path);
// The header and meta section of `path` alone (spec, version, counters, optimizer step: what a
// listing shows), without its tensors and without verifying the checksum, which covers the whole
// file: reading gigabytes to list a directory is what this avoids. The tensors of the result are
// empty. DATA_LOSS when the header or meta does not parse.
absl::StatusOr<HeadCheckpointData> ReadCheckpointMeta(const std::string& path);

// A file's size and the checksum in its header (which covers the whole file), from its header
// alone: what names a file in a checkpoint set's manifest (group_checkpoint.h). Unverified, as
// ReadCheckpointMeta; DATA_LOSS when the header does not parse or the lengths it gives are not
// the file's.
struct CheckpointDigest {
  uint64_t bytes = 0;
  uint64_t checksum = 0;
};
absl::StatusOr<CheckpointDigest> ReadCheckpointDigest(const std::string& path);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_DURABILITY_CHECKPOINT_H_
