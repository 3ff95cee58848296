// Messages read out of gRPC slices: see slice_message.h.
#include "transport/slice_message.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "transport/wire_format.h"

namespace losshead::transport::wire {

void DataPieces::CopyTo(std::byte* out) const {
  for (const auto& [p, n] : pieces) {
    std::memcpy(out, p, n);
    out += n;
  }
}

namespace {

// protobuf's own bounds (google/protobuf/parse_context.h: ReadTag, ReadSize).
constexpr int kMaxTagOrLengthBytes = 5;
constexpr uint64_t kMaxLength = INT32_MAX - 16;

// Reads a serialized message held in gRPC slices without joining them.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) { SkipEmpty(); }

  bool done() const { return index_ == slices_.size(); }

  bool Byte(uint8_t* out) {
    if (done()) return false;
    *out = slices_[index_].begin()[pos_];
    Advance(1);
    return true;
  }
  // A varint of at most `max_bytes` bytes; false past 64 bits.
  bool Varint(uint64_t* out, int max_bytes = 10) {
    uint64_t value = 0;
    for (int i = 0; i < max_bytes; ++i) {
      uint8_t b;
      if (!Byte(&b)) return false;
      const int shift = 7 * i;
      if (shift == 63 && (b & 0x7e) != 0) return false;
      value |= uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) {
        *out = value;
        return true;
      }
    }
    return false;
  }
  // The next `n` bytes as pieces of the slices (no copy).
  bool Pieces(uint64_t n, std::vector<std::pair<const uint8_t*, size_t>>* out) {
    while (n > 0) {
      if (done()) return false;
      const size_t take = std::min<uint64_t>(n, slices_[index_].size() - pos_);
      out->emplace_back(slices_[index_].begin() + pos_, take);
      Advance(take);
      n -= take;
    }
    return true;
  }
  // The next `n` bytes appended to `out`.
  bool Append(uint64_t n, std::string* out) {
    std::vector<std::pair<const uint8_t*, size_t>> pieces;
    if (!Pieces(n, &pieces)) return false;
    for (const auto& [p, size] : pieces) out->append(reinterpret_cast<const char*>(p), size);
    return true;
  }

 private:
  void Advance(size_t n) {
    pos_ += n;
    if (pos_ == slices_[index_].size()) {
      ++index_;
      pos_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (index_ < slices_.size() && slices_[index_].size() == 0) ++index_;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t pos_ = 0;
};

}  // namespace

// Parses `buffer` into `message`, except for the bytes field `data_field`, which is left in
// `data` as pieces of the buffer's slices (the last occurrence, as protobuf would keep).
absl::Status ParseWithoutData(grpc::ByteBuffer& buffer, uint32_t data_field,
                              google::protobuf::MessageLite* message, DataPieces* data) {
  data->slices.clear();
  data->pieces.clear();
  data->size = 0;
  if (!buffer.Dump(&data->slices).ok()) return absl::InternalError("unreadable message");
  SliceCursor in(data->slices);
  std::string rest;  // every other field, as it came
  while (!in.done()) {
    uint64_t tag;
    // What protobuf refuses is refused here too, lest it pass for the data field: a tag or a
    // length takes at most 5 bytes, a tag fits in 32 bits and a length stays under 2 GiB.
    if (!in.Varint(&tag, kMaxTagOrLengthBytes) || tag > UINT32_MAX) {
      return absl::InternalError("malformed message tag");
    }
    const uint32_t wire_type = static_cast<uint32_t>(tag & 7);
    const uint64_t field = tag >> 3;
    bool ok = true;
    if (wire_type == kLengthDelimited) {
      uint64_t n;
      ok = in.Varint(&n, kMaxTagOrLengthBytes) && n <= kMaxLength;
      if (ok && field == data_field) {
        data->pieces.clear();
        data->size = n;
        ok = in.Pieces(n, &data->pieces);
      } else if (ok) {
        AppendVarint(rest, tag);
        AppendVarint(rest, n);
        ok = in.Append(n, &rest);
      }
    } else if (wire_type == kVarint) {
      uint64_t v;
      ok = in.Varint(&v);
      AppendVarint(rest, tag);
      AppendVarint(rest, v);
    } else if (wire_type == kFixed64 || wire_type == kFixed32) {
      AppendVarint(rest, tag);
      ok = in.Append(wire_type == kFixed64 ? 8 : 4, &rest);
    } else {
      return absl::InternalError(absl::StrCat("unexpected wire type ", wire_type, " in a message"));
    }
    if (!ok) return absl::InternalError("truncated message");
  }
  if (!message->ParseFromString(rest)) return absl::InternalError("unparsable message");
  return absl::OkStatus();
}

}  // namespace losshead::transport::wire
