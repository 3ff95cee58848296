#include "server/durability/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/posix_file.h"
#include "server/durability/checkpoint_codec.h"
#include "server/durability/checkpoint_optimizer.h"
#include "common/status_macros.h"

namespace losshead::server {
namespace {

constexpr char kMagic[8] = {'L', 'H', 'C', 'K', 'P', 'T', '\r', '\n'};
constexpr size_t kHeaderBytes = 64;
constexpr uint64_t kPrime = 0x100000001b3ULL;
constexpr uint8_t kHasEvicted = 1;
constexpr uint8_t kHasApplied = 2;
// Format 3: what a remembered result carries besides its outcome.
constexpr uint8_t kHasFingerprint = 1;
constexpr uint8_t kHasFailure = 2;
// Format 4: its token outputs and correct count (a mask of those present follows: bit i for
// TokenOutput i, bit 7 for the correct count: room for more outputs without moving it).
constexpr uint8_t kHasTokenOutputs = 4;
constexpr uint8_t kHasCorrectCount = 0x80;
constexpr uint8_t kKnownOutputs = kHasCorrectCount | ((1u << kTokenOutputs) - 1);
// Format 5: the top-k's ids and log-probs, the two bits after the token outputs'.
constexpr uint8_t kHasTopKIds = 1u << kTokenOutputs;
constexpr uint8_t kHasTopKLogprobs = 1u << (kTokenOutputs + 1);
static_assert(kTokenOutputs + 1 < 7, "token output bits run into kHasCorrectCount");
// Format 6: the output bias record's flag.
constexpr uint8_t kHasBias = 1;
// Format 7: the rows record's flag (a part of a head sharded across processes).
constexpr uint8_t kHasRows = 1;

using checkpoint_codec::Corrupt;
using checkpoint_codec::PutBytes;
using checkpoint_codec::PutF64;
using checkpoint_codec::PutU32;
using checkpoint_codec::PutU64;
using checkpoint_codec::Reader;

std::string EncodeMeta(const HeadCheckpointData& d) {
  std::string out;
  PutBytes(out, d.spec.SerializeAsString());
  for (uint64_t v : {d.weights_version, d.tokens_since_pull, d.microbatches_since_pull,
                     d.min_version_since_pull, d.max_version_since_pull, d.tokens_total,
                     d.microbatches_total}) {
    PutU64(out, v);
  }
  PutU64(out, d.clients.size());
  for (const ClientCheckpoint& c : d.clients) {
    PutBytes(out, c.client_id);
    out.push_back(static_cast<char>((c.max_evicted ? kHasEvicted : 0) |
                                    (c.max_applied ? kHasApplied : 0)));
    PutU64(out, c.max_evicted.value_or(0));
    PutU64(out, c.max_applied.value_or(0));
    PutU64(out, c.results.size());
    for (const auto& [sequence, r] : c.results) {
      PutU64(out, sequence);
      PutF64(out, r->loss_sum);
      PutU64(out, static_cast<uint64_t>(r->token_count));
      PutF64(out, r->loss);
      PutU64(out, r->weights_version);
      PutU32(out, static_cast<uint32_t>(r->grad_hidden_dtype));
      PutBytes(out, r->grad_hidden);
      PutBytes(out, r->per_token_loss);
      uint8_t outputs = r->correct_count.has_value() ? kHasCorrectCount : 0;
      for (int i = 0; i < kTokenOutputs; ++i) {
        if (!r->token_outputs[i].empty()) outputs |= 1u << i;
      }
      if (!r->top_k_ids.empty()) outputs |= kHasTopKIds;
      if (!r->top_k_logprobs.empty()) outputs |= kHasTopKLogprobs;
      out.push_back(static_cast<char>((r->fingerprint ? kHasFingerprint : 0) |
                                      (r->failure.ok() ? 0 : kHasFailure) |
                                      (outputs != 0 ? kHasTokenOutputs : 0)));
      if (r->fingerprint) {
        PutU64(out, r->fingerprint->hidden);
        PutU64(out, r->fingerprint->targets);
        PutBytes(out, r->fingerprint->shape);
      }
      if (!r->failure.ok()) {
        PutU32(out, static_cast<uint32_t>(r->failure.code()));
        PutBytes(out, r->failure.message());
      }
      if (outputs != 0) {
        out.push_back(static_cast<char>(outputs));
        if (r->correct_count.has_value()) PutU64(out, static_cast<uint64_t>(*r->correct_count));
        for (int i = 0; i < kTokenOutputs; ++i) {
          if (outputs & (1u << i)) PutBytes(out, r->token_outputs[i]);
        }
        if (outputs & kHasTopKIds) PutBytes(out, r->top_k_ids);
        if (outputs & kHasTopKLogprobs) PutBytes(out, r->top_k_logprobs);
      }
    }
  }
  EncodeOptimizerMeta(out, d);
  // Format 6: the output bias record, a flags byte (1: the head has one) and, with it, b, db
  // and b's optimizer state (a count, then each), V fp32 each. V floats are small next to W, so
  // they travel in the meta section, under its checksum.
  out.push_back(static_cast<char>(d.spec.bias() ? kHasBias : 0));
  if (d.spec.bias()) {
    PutBytes(out, d.bias);
    PutBytes(out, d.grad_bias);
    PutU64(out, d.bias_optimizer_state.size());
    for (const std::string& state : d.bias_optimizer_state) PutBytes(out, state);
  }
  // Format 7: the rows record, a flags byte (1: the tensors hold only the rows it names) and,
  // with it, where the rows lie among the group's shards.
  out.push_back(static_cast<char>(d.rows.has_value() ? kHasRows : 0));
  if (d.rows.has_value()) {
    const CheckpointRows& rows = *d.rows;
    for (uint32_t v : {rows.processes, rows.process, rows.shards, rows.first_shard, rows.devices}) {
      PutU32(out, v);
    }
    PutU64(out, rows.first_row);
    PutU64(out, rows.row_count);
  }
  return out;
}

// Format 7's rows record (EncodeMeta): present exactly for a head sharded across processes.
absl::Status DecodeRows(Reader& r, HeadCheckpointData* d) {
  uint8_t flags;
  if (!r.U8(&flags) || (flags & ~kHasRows) != 0) return Corrupt("rows flags");
  if (((flags & kHasRows) != 0) != d->spec.placement().across_processes()) {
    return Corrupt("rows record does not match the spec's placement");
  }
  if (flags == 0) return absl::OkStatus();
  CheckpointRows& rows = d->rows.emplace();
  for (uint32_t* v :
       {&rows.processes, &rows.process, &rows.shards, &rows.first_shard, &rows.devices}) {
    if (!r.U32(v)) return Corrupt("rows record");
  }
  if (!r.U64(&rows.first_row) || !r.U64(&rows.row_count)) return Corrupt("rows record");
  if (rows.process >= rows.processes || rows.devices == 0 ||
      rows.first_shard + static_cast<uint64_t>(rows.devices) > rows.shards ||
      rows.row_count == 0 || rows.first_row + rows.row_count > d->spec.vocab_size()) {
    return Corrupt("rows record out of range");
  }
  return absl::OkStatus();
}

// Format 6's output bias record (EncodeMeta).
absl::Status DecodeBias(Reader& r, HeadCheckpointData* d) {
  uint8_t flags;
  if (!r.U8(&flags) || (flags & ~kHasBias) != 0) return Corrupt("output bias flags");
  if (((flags & kHasBias) != 0) != d->spec.bias()) {
    return Corrupt("output bias record does not match the spec");
  }
  if (!d->spec.bias()) return absl::OkStatus();
  uint64_t states;
  if (!r.Bytes(&d->bias) || !r.Bytes(&d->grad_bias) || !r.U64(&states)) {
    return Corrupt("output bias record");
  }
  // Each buffer takes at least its 8-byte length: bound the count before reserving anything.
  if (states > r.left() / 8) return Corrupt("output bias state count exceeds the data");
  d->bias_optimizer_state.resize(states);
  for (std::string& state : d->bias_optimizer_state) {
    if (!r.Bytes(&state)) return Corrupt("output bias optimizer state");
  }
  return absl::OkStatus();
}

// Format 3's additions to a remembered result: its fingerprint and remembered failure; format 4's:
// its token outputs; format 5's: its top-k.
absl::Status DecodeResultExtras(Reader& r, uint32_t version, StepOutcome* outcome) {
  uint8_t flags;
  if (!r.U8(&flags)) return Corrupt("remembered result flags");
  const uint8_t known = kHasFingerprint | kHasFailure | (version >= 4 ? kHasTokenOutputs : 0);
  if (flags & ~known) return Corrupt("remembered result flags");
  if (flags & kHasFingerprint) {
    StepFingerprint& f = outcome->fingerprint.emplace();
    if (!r.U64(&f.hidden) || !r.U64(&f.targets) || !r.Bytes(&f.shape)) {
      return Corrupt("remembered result fingerprint");
    }
  }
  if (flags & kHasFailure) {
    uint32_t code;
    std::string message;
    if (!r.U32(&code) || !r.Bytes(&message)) return Corrupt("remembered failure");
    if (code == 0 || code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
      return Corrupt("remembered failure code");
    }
    outcome->failure = absl::Status(static_cast<absl::StatusCode>(code), message);
  }
  if (flags & kHasTokenOutputs) {
    uint8_t outputs;
    const uint8_t known_outputs =
        kKnownOutputs | (version >= 5 ? kHasTopKIds | kHasTopKLogprobs : 0);
    if (!r.U8(&outputs) || outputs == 0 || (outputs & ~known_outputs) != 0) {
      return Corrupt("remembered token outputs");
    }
    if (outputs & kHasCorrectCount) {
      uint64_t correct;
      if (!r.U64(&correct)) return Corrupt("remembered correct count");
      outcome->correct_count = static_cast<int64_t>(correct);
    }
    for (int i = 0; i < kTokenOutputs; ++i) {
      if ((outputs & (1u << i)) && !r.Bytes(&outcome->token_outputs[i])) {
        return Corrupt("remembered token outputs");
      }
    }
    if (((outputs & kHasTopKIds) && !r.Bytes(&outcome->top_k_ids)) ||
        ((outputs & kHasTopKLogprobs) && !r.Bytes(&outcome->top_k_logprobs))) {
      return Corrupt("remembered top-k");
    }
  }
  return absl::OkStatus();
}

// `version` is the file's format version: 1 has no optimizer record, 1 and 2 no fingerprints or
// remembered failures, 1 to 3 no token outputs, 1 to 4 no top-k. The optimizer tensors' lengths go
// to `optimizer_lengths`.
absl::Status DecodeMeta(absl::string_view meta, uint32_t version, HeadCheckpointData* d,
                        std::vector<uint64_t>* optimizer_lengths) {
  Reader r(meta);
  std::string spec;
  if (!r.Bytes(&spec) || !d->spec.ParseFromString(spec)) return Corrupt("head spec");
  for (uint64_t* v : {&d->weights_version, &d->tokens_since_pull, &d->microbatches_since_pull,
                      &d->min_version_since_pull, &d->max_version_since_pull, &d->tokens_total,
                      &d->microbatches_total}) {
    if (!r.U64(v)) return Corrupt("counters");
  }
  uint64_t clients;
  if (!r.U64(&clients)) return Corrupt("client count");
  // Each client takes at least 33 bytes: bound the count before reserving anything.
  if (clients > r.left() / 33) return Corrupt("client count exceeds the data");
  d->clients.resize(clients);
  for (ClientCheckpoint& c : d->clients) {
    uint8_t flags;
    uint64_t evicted, applied, results;
    if (!r.Bytes(&c.client_id) || !r.U8(&flags) || !r.U64(&evicted) || !r.U64(&applied) ||
        !r.U64(&results)) {
      return Corrupt("client record");
    }
    if (flags & ~(kHasEvicted | kHasApplied)) return Corrupt("client flags");
    if (flags & kHasEvicted) c.max_evicted = evicted;
    if (flags & kHasApplied) c.max_applied = applied;
    if (results > r.left() / 60) return Corrupt("result count exceeds the data");
    c.results.reserve(results);
    for (uint64_t i = 0; i < results; ++i) {
      auto outcome = std::make_shared<StepOutcome>();
      uint64_t sequence, tokens;
      uint32_t dtype;
      if (!r.U64(&sequence) || !r.F64(&outcome->loss_sum) || !r.U64(&tokens) ||
          !r.F64(&outcome->loss) || !r.U64(&outcome->weights_version) || !r.U32(&dtype) ||
          !r.Bytes(&outcome->grad_hidden) || !r.Bytes(&outcome->per_token_loss)) {
        return Corrupt("remembered result");
      }
      if (!v1::DType_IsValid(static_cast<int>(dtype))) return Corrupt("result dtype");
      if (!c.results.empty() && sequence <= c.results.back().first) {
        return Corrupt("remembered results out of order");
      }
      if (version >= 3) LOSSHEAD_RETURN_IF_ERROR(DecodeResultExtras(r, version, outcome.get()));
      outcome->token_count = static_cast<int64_t>(tokens);
      outcome->grad_hidden_dtype = static_cast<v1::DType>(dtype);
      c.results.emplace_back(sequence, std::move(outcome));
    }
  }
  optimizer_lengths->clear();
  if (version >= 2) {
    LOSSHEAD_RETURN_IF_ERROR(DecodeOptimizerMeta(r, version, d, optimizer_lengths));
  }
  if (version >= 6) {
    LOSSHEAD_RETURN_IF_ERROR(DecodeBias(r, d));
  } else if (d->spec.bias()) {
    return Corrupt("a head with an output bias in a format older than 6");
  }
  if (version >= 7) {
    LOSSHEAD_RETURN_IF_ERROR(DecodeRows(r, d));
  } else if (d->spec.placement().across_processes()) {
    return Corrupt("a head sharded across processes in a format older than 7");
  }
  if (r.left() != 0) return Corrupt("trailing bytes after the meta records");
  return absl::OkStatus();
}

struct Header {
  uint32_t version = 0;
  uint64_t meta_bytes = 0;
  uint64_t weights_bytes = 0;
  uint64_t gradient_bytes = 0;
  uint64_t checksum = 0;
  // Version 2: the optimizer section, pieces of equal length (zero both when there is none).
  uint64_t optimizer_bytes = 0;
  uint64_t optimizer_piece_bytes = 0;
};

// The checksum's seed: the lengths, so a file cut or extended at a section boundary is refused.
uint64_t HeaderSeed(const Header& h) {
  std::string fields;
  PutU32(fields, h.version);
  PutU64(fields, h.meta_bytes);
  PutU64(fields, h.weights_bytes);
  PutU64(fields, h.gradient_bytes);
  if (h.version >= 2) {
    PutU64(fields, h.optimizer_bytes);
    PutU64(fields, h.optimizer_piece_bytes);
  }
  return Checksum(fields);
}

uint64_t FullChecksum(const Header& h, absl::string_view meta, absl::string_view weights,
                      absl::string_view gradient,
                      const std::vector<absl::string_view>& optimizer = {}) {
  uint64_t sum = Checksum(gradient, Checksum(weights, Checksum(meta, HeaderSeed(h))));
  for (absl::string_view piece : optimizer) sum = Checksum(piece, sum);
  return sum;
}

// The header of a file holding `meta` and `data`'s tensors, checksum included.
Header HeaderFor(absl::string_view meta, const HeadCheckpointData& data) {
  const std::vector<absl::string_view> optimizer = OptimizerSection(data);
  Header h{.version = kCheckpointFormatVersion,
           .meta_bytes = meta.size(),
           .weights_bytes = data.weights.size(),
           .gradient_bytes = data.gradient.size(),
           .optimizer_bytes = optimizer.empty() ? 0 : optimizer.size() * optimizer[0].size(),
           .optimizer_piece_bytes = optimizer.empty() ? 0 : optimizer[0].size()};
  h.checksum = FullChecksum(h, meta, data.weights, data.gradient, optimizer);
  return h;
}

// The optimizer section cut into the header's pieces.
std::vector<absl::string_view> Pieces(absl::string_view section, uint64_t piece_bytes) {
  std::vector<absl::string_view> pieces;
  for (; !section.empty(); section.remove_prefix(piece_bytes)) {
    pieces.push_back(section.substr(0, piece_bytes));
  }
  return pieces;
}

std::string EncodeHeader(const Header& h) {
  std::string out(kMagic, sizeof(kMagic));
  PutU32(out, h.version);
  PutU32(out, 0);
  PutU64(out, h.meta_bytes);
  PutU64(out, h.weights_bytes);
  PutU64(out, h.gradient_bytes);
  PutU64(out, h.checksum);
  PutU64(out, h.optimizer_bytes);
  PutU64(out, h.optimizer_piece_bytes);
  out.resize(kHeaderBytes, '\0');
  return out;
}

absl::StatusOr<Header> DecodeHeader(absl::string_view bytes, uint64_t file_bytes) {
  if (bytes.size() < kHeaderBytes) return Corrupt("shorter than its header");
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return Corrupt("bad magic (not a losshead checkpoint)");
  }
  Reader r(bytes.substr(sizeof(kMagic), kHeaderBytes - sizeof(kMagic)));
  Header h;
  uint32_t reserved;
  r.U32(&h.version);
  r.U32(&reserved);
  r.U64(&h.meta_bytes);
  r.U64(&h.weights_bytes);
  r.U64(&h.gradient_bytes);
  r.U64(&h.checksum);
  r.U64(&h.optimizer_bytes);  // version 1: reserved zeros
  r.U64(&h.optimizer_piece_bytes);
  // Reserved bytes are outside the checksum: insist on zeros so that no byte goes unchecked.
  if (reserved != 0 || (h.version < 2 && (h.optimizer_bytes | h.optimizer_piece_bytes) != 0)) {
    return Corrupt("reserved header bytes are not zero");
  }
  if (h.version < 1 || h.version > kCheckpointFormatVersion) {
    return absl::DataLossError(absl::StrCat("checkpoint format version ", h.version,
                                            " is not supported (this server reads 1 to ",
                                            kCheckpointFormatVersion, ")"));
  }
  if ((h.optimizer_piece_bytes == 0) != (h.optimizer_bytes == 0) ||
      (h.optimizer_piece_bytes != 0 && h.optimizer_bytes % h.optimizer_piece_bytes != 0)) {
    return Corrupt("optimizer section lengths");
  }
  const uint64_t body = file_bytes - kHeaderBytes;
  if (h.meta_bytes > body || h.weights_bytes > body - h.meta_bytes ||
      h.optimizer_bytes > body - h.meta_bytes - h.weights_bytes ||
      h.gradient_bytes != body - h.meta_bytes - h.weights_bytes - h.optimizer_bytes) {
    return Corrupt(absl::StrCat("section lengths ", h.meta_bytes, " + ", h.weights_bytes, " + ",
                                h.gradient_bytes, " + ", h.optimizer_bytes,
                                " do not match the file's ", body,
                                " bytes after the header (torn write?)"));
  }
  return h;
}

absl::Status ReadAll(int fd, char* out, size_t bytes, const std::string& path) {
  while (bytes > 0) {
    const ssize_t n = ::read(fd, out, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("cannot read", path);
    }
    if (n == 0) return absl::DataLossError(absl::StrCat("unexpected end of file in ", path));
    out += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t Checksum(absl::string_view data, uint64_t seed) {
  uint64_t lane[4];
  for (int i = 0; i < 4; ++i) lane[i] = seed + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(i);
  const char* p = data.data();
  size_t n = data.size();
  auto mix = [](uint64_t h, uint64_t w) {
    h = (h ^ w) * kPrime;
    return h ^ (h >> 32);  // carries high bits down; a bijection, so no change is lost
  };
  while (n >= 32) {
    uint64_t w[4];
    std::memcpy(w, p, 32);
    for (int i = 0; i < 4; ++i) lane[i] = mix(lane[i], w[i]);
    p += 32;
    n -= 32;
  }
  for (; n > 0; --n, ++p) lane[0] = mix(lane[0], static_cast<unsigned char>(*p));
  uint64_t h = 0xcbf29ce484222325ULL;
  for (uint64_t l : lane) {
    for (int b = 0; b < 8; ++b) h = (h ^ ((l >> (8 * b)) & 0xff)) * kPrime;
  }
  return h;
}

std::string EncodeCheckpoint(const HeadCheckpointData& data) {
  const std::string meta = EncodeMeta(data);
  std::string file =
      absl::StrCat(EncodeHeader(HeaderFor(meta, data)), meta, data.weights, data.gradient);
  for (absl::string_view piece : OptimizerSection(data)) absl::StrAppend(&file, piece);
  return file;
}

absl::StatusOr<HeadCheckpointData> DecodeCheckpoint(absl::string_view file) {
  LOSSHEAD_ASSIGN_OR_RETURN(const Header h, DecodeHeader(file, file.size()));
  file.remove_prefix(kHeaderBytes);
  const absl::string_view meta = file.substr(0, h.meta_bytes);
  const absl::string_view weights = file.substr(h.meta_bytes, h.weights_bytes);
  const absl::string_view gradient = file.substr(h.meta_bytes + h.weights_bytes, h.gradient_bytes);
  const std::vector<absl::string_view> optimizer = Pieces(
      file.substr(h.meta_bytes + h.weights_bytes + h.gradient_bytes), h.optimizer_piece_bytes);
  if (FullChecksum(h, meta, weights, gradient, optimizer) != h.checksum) {
    return Corrupt("checksum mismatch");
  }
  HeadCheckpointData d;
  std::vector<uint64_t> lengths;
  LOSSHEAD_RETURN_IF_ERROR(DecodeMeta(meta, h.version, &d, &lengths));
  d.weights.assign(weights.data(), weights.size());
  d.gradient.assign(gradient.data(), gradient.size());
  LOSSHEAD_RETURN_IF_ERROR(AssignOptimizerSection(
      std::vector<std::string>(optimizer.begin(), optimizer.end()), lengths, &d));
  return d;
}

absl::StatusOr<uint64_t> WriteCheckpointFile(const std::string& path,
                                             const HeadCheckpointData& data) {
  const std::string meta = EncodeMeta(data);
  const Header h = HeaderFor(meta, data);
  const std::string header = EncodeHeader(h);
  std::vector<absl::string_view> pieces = {header, meta, data.weights, data.gradient};
  for (absl::string_view piece : OptimizerSection(data)) pieces.push_back(piece);
  LOSSHEAD_RETURN_IF_ERROR(WriteFileAtomically(path, pieces));
  return kHeaderBytes + meta.size() + data.weights.size() + data.gradient.size() +
         h.optimizer_bytes;
}

absl::StatusOr<HeadCheckpointData> ReadCheckpointFile(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return PosixError("cannot open", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return PosixError("cannot stat", path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  auto in_file = [&path](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  };
  std::string header(kHeaderBytes, '\0');
  if (size < kHeaderBytes) return in_file(Corrupt("shorter than its header"));
  LOSSHEAD_RETURN_IF_ERROR(ReadAll(fd.get(), header.data(), kHeaderBytes, path));
  absl::StatusOr<Header> h = DecodeHeader(header, size);
  if (!h.ok()) return in_file(h.status());
  std::string meta(h->meta_bytes, '\0');
  HeadCheckpointData d;
  d.weights.resize(h->weights_bytes);
  d.gradient.resize(h->gradient_bytes);
  LOSSHEAD_RETURN_IF_ERROR(ReadAll(fd.get(), meta.data(), meta.size(), path));
  LOSSHEAD_RETURN_IF_ERROR(ReadAll(fd.get(), d.weights.data(), d.weights.size(), path));
  LOSSHEAD_RETURN_IF_ERROR(ReadAll(fd.get(), d.gradient.data(), d.gradient.size(), path));
  std::vector<std::string> optimizer(
      h->optimizer_piece_bytes == 0 ? 0 : h->optimizer_bytes / h->optimizer_piece_bytes);
  for (std::string& piece : optimizer) {
    piece.resize(h->optimizer_piece_bytes);
    LOSSHEAD_RETURN_IF_ERROR(ReadAll(fd.get(), piece.data(), piece.size(), path));
  }
  if (FullChecksum(*h, meta, d.weights, d.gradient,
                   std::vector<absl::string_view>(optimizer.begin(), optimizer.end())) !=
      h->checksum) {
    return in_file(Corrupt("checksum mismatch"));
  }
  std::vector<uint64_t> lengths;
  absl::Status s = DecodeMeta(meta, h->version, &d, &lengths);
  if (s.ok()) s = AssignOptimizerSection(std::move(optimizer), lengths, &d);
  if (!s.ok()) return in_file(s);
  return d;
}

namespace {

// A checkpoint file opened and its header read and checked, the descriptor left just past it.
struct OpenedCheckpoint {
  explicit OpenedCheckpoint(int raw) : fd(raw) {}
  UniqueFd fd;
  uint64_t size = 0;
  Header header;
};

absl::Status InFile(const std::string& path, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
}

absl::StatusOr<std::unique_ptr<OpenedCheckpoint>> OpenCheckpoint(const std::string& path) {
  auto opened = std::make_unique<OpenedCheckpoint>(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (opened->fd.get() < 0) return PosixError("cannot open", path);
  struct stat st;
  if (::fstat(opened->fd.get(), &st) != 0) return PosixError("cannot stat", path);
  opened->size = static_cast<uint64_t>(st.st_size);
  if (opened->size < kHeaderBytes) return InFile(path, Corrupt("shorter than its header"));
  std::string header(kHeaderBytes, '\0');
  LOSSHEAD_RETURN_IF_ERROR(ReadAll(opened->fd.get(), header.data(), kHeaderBytes, path));
  absl::StatusOr<Header> h = DecodeHeader(header, opened->size);
  if (!h.ok()) return InFile(path, h.status());
  opened->header = *h;
  return opened;
}

}  // namespace

absl::StatusOr<HeadCheckpointData> ReadCheckpointMeta(const std::string& path) {
  LOSSHEAD_ASSIGN_OR_RETURN(std::unique_ptr<OpenedCheckpoint> opened, OpenCheckpoint(path));
  std::string meta(opened->header.meta_bytes, '\0');
  LOSSHEAD_RETURN_IF_ERROR(ReadAll(opened->fd.get(), meta.data(), meta.size(), path));
  HeadCheckpointData d;
  std::vector<uint64_t> lengths;
  if (absl::Status s = DecodeMeta(meta, opened->header.version, &d, &lengths); !s.ok()) {
    return InFile(path, s);
  }
  return d;
}

absl::StatusOr<CheckpointDigest> ReadCheckpointDigest(const std::string& path) {
  LOSSHEAD_ASSIGN_OR_RETURN(std::unique_ptr<OpenedCheckpoint> opened, OpenCheckpoint(path));
  return CheckpointDigest{.bytes = opened->size, .checksum = opened->header.checksum};
}

}  // namespace losshead::server
