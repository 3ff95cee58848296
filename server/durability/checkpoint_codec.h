// The little-endian encoding that checkpoint files use (checkpoint.h), shared by the file's
// parts. The server only builds on little-endian hosts (x86-64, aarch64), so the in-memory
// representation is the file's.
#ifndef LOSSHEAD_SERVER_DURABILITY_CHECKPOINT_CODEC_H_
#define LOSSHEAD_SERVER_DURABILITY_CHECKPOINT_CODEC_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace losshead::server::checkpoint_codec {

inline void PutU64(std::string& out, uint64_t v) {
  out.append(reinterpret_cast<const char*>(&v), 8);
}
inline void PutU32(std::string& out, uint32_t v) {
  out.append(reinterpret_cast<const char*>(&v), 4);
}
inline void PutF64(std::string& out, double v) { out.append(reinterpret_cast<const char*>(&v), 8); }
inline void PutBytes(std::string& out, absl::string_view s) {
  PutU64(out, s.size());
  out.append(s.data(), s.size());
}

// Reads what the Put functions wrote; each read is false (and consumes nothing) past the end.
class Reader {
 public:
  explicit Reader(absl::string_view data) : data_(data) {}
  bool U64(uint64_t* v) { return Raw(v, 8); }
  bool U32(uint32_t* v) { return Raw(v, 4); }
  bool U8(uint8_t* v) { return Raw(v, 1); }
  bool F64(double* v) { return Raw(v, 8); }
  bool Bytes(std::string* s) {
    uint64_t n;
    if (!U64(&n) || n > data_.size()) return false;
    s->assign(data_.data(), n);
    data_.remove_prefix(n);
    return true;
  }
  size_t left() const { return data_.size(); }

 private:
  bool Raw(void* v, size_t n) {
    if (data_.size() < n) return false;
    std::memcpy(v, data_.data(), n);
    data_.remove_prefix(n);
    return true;
  }
  absl::string_view data_;
};

inline absl::Status Corrupt(absl::string_view what) {
  return absl::DataLossError(absl::StrCat("corrupt checkpoint: ", what));
}

}  // namespace losshead::server::checkpoint_codec

#endif  // LOSSHEAD_SERVER_DURABILITY_CHECKPOINT_CODEC_H_
