// The protobuf wire format pieces that raw (byte-buffer) methods write by hand: tags and varints.
// The client's transfers and the server's Step responses frame their payload fields themselves so
// that tensor bytes are referenced rather than copied into a message.
#ifndef LOSSHEAD_TRANSPORT_WIRE_FORMAT_H_
#define LOSSHEAD_TRANSPORT_WIRE_FORMAT_H_

#include <cstdint>
#include <string>

namespace losshead::transport::wire {

inline constexpr uint32_t kVarint = 0;
inline constexpr uint32_t kFixed64 = 1;
inline constexpr uint32_t kLengthDelimited = 2;
inline constexpr uint32_t kFixed32 = 5;

inline void AppendVarint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

inline void AppendTag(std::string& out, uint32_t field, uint32_t wire_type) {
  AppendVarint(out, (uint64_t{field} << 3) | wire_type);
}

}  // namespace losshead::transport::wire

#endif  // LOSSHEAD_TRANSPORT_WIRE_FORMAT_H_
