#include "server/durability/checkpoint_optimizer.h"

#include <utility>

namespace losshead::server {

using checkpoint_codec::Corrupt;
using checkpoint_codec::PutBytes;
using checkpoint_codec::PutU64;

void EncodeOptimizerMeta(std::string& out, const HeadCheckpointData& d) {
  PutU64(out, d.optimizer_step);
  out.push_back(d.momentum_started ? 1 : 0);
  PutU64(out, d.master_version);
  PutU64(out, d.master.size());
  PutU64(out, d.optimizer_state.size());
  for (const std::string& state : d.optimizer_state) PutU64(out, state.size());
  PutU64(out, d.applies.size());
  for (const ApplyClientCheckpoint& c : d.applies) {
    PutBytes(out, c.client_id);
    PutU64(out, c.max_applied);
    PutU64(out, c.responses.size());
    for (const RememberedApply& apply : c.responses) {
      PutU64(out, apply.key);
      PutBytes(out, apply.response.SerializeAsString());
      PutBytes(out, apply.fingerprint);
    }
  }
}

absl::Status DecodeOptimizerMeta(checkpoint_codec::Reader& r, uint32_t version,
                                 HeadCheckpointData* d, std::vector<uint64_t>* lengths) {
  uint8_t momentum;
  uint64_t master, buffers;
  if (!r.U64(&d->optimizer_step) || !r.U8(&momentum) || !r.U64(&d->master_version) ||
      !r.U64(&master) || !r.U64(&buffers)) {
    return Corrupt("optimizer record");
  }
  if (momentum > 1) return Corrupt("optimizer momentum flag");
  d->momentum_started = momentum == 1;
  if (buffers > r.left() / 8) return Corrupt("optimizer buffer count exceeds the data");
  lengths->assign(1, master);
  for (uint64_t i = 0; i < buffers; ++i) {
    uint64_t n;
    if (!r.U64(&n)) return Corrupt("optimizer buffer length");
    lengths->push_back(n);
  }
  uint64_t clients;
  if (!r.U64(&clients)) return Corrupt("apply client count");
  // Each client takes at least 24 bytes: bound the count before reserving anything.
  if (clients > r.left() / 24) return Corrupt("apply client count exceeds the data");
  d->applies.resize(clients);
  for (ApplyClientCheckpoint& c : d->applies) {
    uint64_t responses;
    if (!r.Bytes(&c.client_id) || !r.U64(&c.max_applied) || !r.U64(&responses)) {
      return Corrupt("apply client record");
    }
    if (responses > r.left() / 16) return Corrupt("apply response count exceeds the data");
    c.responses.reserve(responses);
    for (uint64_t i = 0; i < responses; ++i) {
      RememberedApply apply;
      std::string bytes;
      if (!r.U64(&apply.key) || !r.Bytes(&bytes) || !apply.response.ParseFromString(bytes) ||
          (version >= 3 && !r.Bytes(&apply.fingerprint))) {
        return Corrupt("remembered apply");
      }
      if ((!c.responses.empty() && apply.key <= c.responses.back().key) ||
          apply.key > c.max_applied) {
        return Corrupt("remembered applies out of order");
      }
      c.responses.push_back(std::move(apply));
    }
  }
  return absl::OkStatus();
}

std::vector<absl::string_view> OptimizerSection(const HeadCheckpointData& d) {
  std::vector<absl::string_view> pieces;
  if (!d.master.empty()) pieces.emplace_back(d.master);
  for (const std::string& state : d.optimizer_state) pieces.emplace_back(state);
  return pieces;
}

absl::Status AssignOptimizerSection(std::vector<std::string> pieces,
                                    const std::vector<uint64_t>& lengths, HeadCheckpointData* d) {
  // lengths: master (0 when none), then each state buffer.
  const size_t skip = !lengths.empty() && lengths[0] == 0 ? 1 : 0;
  if (lengths.size() - skip != pieces.size()) {
    return Corrupt("optimizer section does not match its record");
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (lengths[i + skip] != pieces[i].size()) {
      return Corrupt("optimizer buffer length does not match its record");
    }
  }
  d->master.clear();
  d->optimizer_state.clear();
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (i == 0 && skip == 0) {
      d->master = std::move(pieces[i]);
    } else {
      d->optimizer_state.push_back(std::move(pieces[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace losshead::server
