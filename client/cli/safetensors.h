// The safetensors file format, written and read by `losshead export` and `losshead import`.
//
// A file is an 8-byte little-endian unsigned header length N, then N bytes of UTF-8 JSON, then
// the tensors' bytes. The JSON maps each tensor's name to {"dtype", "shape", "data_offsets":
// [begin, end]} (byte offsets into the data that follows the header, end exclusive) and may hold
// "__metadata__", a map of strings to strings. Tensors are row-major and little-endian; together
// they cover the data exactly, with no gap and no overlap. The header is padded with spaces to a
// multiple of 8 bytes so that every tensor starts aligned (what the reference writer does).
#ifndef LOSSHEAD_CLIENT_CLI_SAFETENSORS_H_
#define LOSSHEAD_CLIENT_CLI_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::cli {

struct SafetensorsTensor {
  std::string name;
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;  // BF16, FP16 or FP32
  std::vector<int64_t> shape;
  absl::string_view data;  // product(shape) elements of dtype
};

// "BF16", "F16", "F32" (the format's names); empty for any other dtype.
std::string SafetensorsDType(v1::DType dtype);

// The file's first bytes: the length and the padded JSON, the tensors laid out back to back in
// the order given. INVALID_ARGUMENT for an unsupported dtype, a data size that does not match the
// shape, an empty or repeated name, or "__metadata__" as a tensor name.
absl::StatusOr<std::string> SafetensorsHeader(const std::vector<SafetensorsTensor>& tensors,
                                              const std::map<std::string, std::string>& metadata);

// Writes the whole file atomically: `path`.tmp written and fsynced, then renamed over `path`, so a
// failure or a crash never leaves a partial file under the name. Errors name the path.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensor>& tensors,
                              const std::map<std::string, std::string>& metadata);

// One tensor of a file as its header describes it.
struct SafetensorsEntry {
  std::string dtype;  // the format's name, e.g. "BF16"
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // offsets into the data section
  uint64_t end = 0;
};

struct SafetensorsIndex {
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + the header length
  uint64_t file_bytes = 0;
};

// Reads and checks the header of `path`: the length within the file, valid JSON, every entry's
// dtype known, its shape non-negative and its offsets inside the data with end - begin equal to
// the shape's bytes, the tensors covering the data exactly. INVALID_ARGUMENT names what is wrong;
// NOT_FOUND for a missing file.
absl::StatusOr<SafetensorsIndex> ReadSafetensorsIndex(const std::string& path);
// The bytes of tensor `name` (NOT_FOUND naming the tensors the file has).
absl::StatusOr<std::string> ReadSafetensorsTensor(const std::string& path,
                                                  const SafetensorsIndex& index,
                                                  const std::string& name);

// Hexadecimal SHA-256 of `data` (the manifest's digests; `sha256sum` prints the same).
std::string Sha256Hex(absl::string_view data);
// `text` as a JSON string literal, quotes included.
std::string JsonString(absl::string_view text);

}  // namespace losshead::cli

#endif  // LOSSHEAD_CLIENT_CLI_SAFETENSORS_H_
