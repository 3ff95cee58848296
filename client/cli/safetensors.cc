#include "client/cli/safetensors.h"

#include <fcntl.h>
#include <openssl/sha.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/posix_file.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace losshead::cli {
namespace {

// The reference implementation refuses larger headers; so do we, before allocating one.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

uint64_t ElementBytes(absl::string_view dtype) {
  if (dtype == "BF16" || dtype == "F16") return 2;
  if (dtype == "F32") return 4;
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" ||
      dtype == "F8_E5M2") {
    return 1;
  }
  return 0;
}

absl::Status ReadAt(int fd, uint64_t offset, char* out, uint64_t bytes, const std::string& path) {
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, out, bytes, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("cannot read", path);
    }
    if (n == 0) return absl::InvalidArgumentError(absl::StrCat(path, ": unexpected end of file"));
    out += n;
    offset += static_cast<uint64_t>(n);
    bytes -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": not a valid safetensors file: ", what));
}

// A JSON number that must be a non-negative integer below 2^53 (exact in a double).
bool AsCount(const google::protobuf::Value& v, uint64_t* out) {
  if (v.kind_case() != google::protobuf::Value::kNumberValue) return false;
  const double d = v.number_value();
  if (!(d >= 0) || d > 9007199254740992.0 || std::floor(d) != d) return false;
  *out = static_cast<uint64_t>(d);
  return true;
}

}  // namespace

std::string SafetensorsDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return "BF16";
    case v1::DTYPE_FP16:
      return "F16";
    case v1::DTYPE_FP32:
      return "F32";
    default:
      return "";
  }
}

std::string JsonString(absl::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
        } else {
          out += c;  // UTF-8 passes through as it is
        }
    }
  }
  out += '"';
  return out;
}

std::string Sha256Hex(absl::string_view data) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest);
  std::string hex;
  hex.reserve(2 * SHA256_DIGEST_LENGTH);
  for (unsigned char b : digest) absl::StrAppendFormat(&hex, "%02x", b);
  return hex;
}

absl::StatusOr<std::string> SafetensorsHeader(const std::vector<SafetensorsTensor>& tensors,
                                              const std::map<std::string, std::string>& metadata) {
  std::vector<std::string> entries;
  if (!metadata.empty()) {
    std::vector<std::string> pairs;
    for (const auto& [key, value] : metadata) {
      pairs.push_back(absl::StrCat(JsonString(key), ":", JsonString(value)));
    }
    entries.push_back(absl::StrCat("\"__metadata__\":{", absl::StrJoin(pairs, ","), "}"));
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    const std::string dtype = SafetensorsDType(t.dtype);
    if (dtype.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name, "': dtype ", v1::DType_Name(t.dtype), " is not BF16, FP16 or FP32"));
    }
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name '", t.name, "' is empty, reserved or repeated"));
    }
    uint64_t elements = 1;
    for (const int64_t d : t.shape) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': shape"));
      elements *= static_cast<uint64_t>(d);
    }
    if (elements * ElementBytes(dtype) != t.data.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': ", t.data.size(),
                                                     " bytes do not hold its shape [",
                                                     absl::StrJoin(t.shape, ", "), "] of ", dtype));
    }
    entries.push_back(absl::StrCat(JsonString(t.name), ":{\"dtype\":\"", dtype, "\",\"shape\":[",
                                   absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", offset, ",",
                                   offset + t.data.size(), "]}"));
    offset += t.data.size();
  }
  std::string json = absl::StrCat("{", absl::StrJoin(entries, ","), "}");
  json.resize((json.size() + 7) / 8 * 8, ' ');
  std::string header(8, '\0');
  const uint64_t length = json.size();
  for (int i = 0; i < 8; ++i) header[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return header + json;
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::string> header = SafetensorsHeader(tensors, metadata);
  if (!header.ok()) return header.status();
  std::vector<absl::string_view> pieces = {*header};
  for (const SafetensorsTensor& t : tensors) pieces.push_back(t.data);
  return WriteFileAtomically(path, pieces);
}

absl::StatusOr<SafetensorsIndex> ReadSafetensorsIndex(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return PosixError("cannot open", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return PosixError("cannot stat", path);
  SafetensorsIndex index;
  index.file_bytes = static_cast<uint64_t>(st.st_size);
  if (index.file_bytes < 8) return Bad(path, "shorter than its 8-byte header length");
  unsigned char length_bytes[8];
  if (absl::Status s = ReadAt(fd.get(), 0, reinterpret_cast<char*>(length_bytes), 8, path);
      !s.ok()) {
    return s;
  }
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= static_cast<uint64_t>(length_bytes[i]) << (8 * i);
  if (length > kMaxHeaderBytes || length > index.file_bytes - 8) {
    return Bad(path, absl::StrCat("header length ", length, " exceeds the file"));
  }
  std::string json(length, '\0');
  if (absl::Status s = ReadAt(fd.get(), 8, json.data(), length, path); !s.ok()) return s;
  index.data_start = 8 + length;
  google::protobuf::Struct header;
  if (json.empty() || json.front() != '{' ||
      !google::protobuf::util::JsonStringToMessage(json, &header).ok()) {
    return Bad(path, "the header is not a JSON object");
  }
  const uint64_t data_bytes = index.file_bytes - index.data_start;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const auto& [name, value] : header.fields()) {
    if (name == "__metadata__") {
      if (value.kind_case() != google::protobuf::Value::kStructValue) {
        return Bad(path, "__metadata__ is not an object");
      }
      for (const auto& [key, v] : value.struct_value().fields()) {
        if (v.kind_case() != google::protobuf::Value::kStringValue) {
          return Bad(path, absl::StrCat("__metadata__ value of '", key, "' is not a string"));
        }
        index.metadata[key] = v.string_value();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor '", name, "': ");
    if (value.kind_case() != google::protobuf::Value::kStructValue) {
      return Bad(path, absl::StrCat(where, "not an object"));
    }
    const auto& fields = value.struct_value().fields();
    const auto dtype = fields.find("dtype");
    const auto shape = fields.find("shape");
    const auto offsets = fields.find("data_offsets");
    if (dtype == fields.end() || shape == fields.end() || offsets == fields.end() ||
        dtype->second.kind_case() != google::protobuf::Value::kStringValue ||
        shape->second.kind_case() != google::protobuf::Value::kListValue ||
        offsets->second.kind_case() != google::protobuf::Value::kListValue ||
        offsets->second.list_value().values_size() != 2) {
      return Bad(path, absl::StrCat(where, "needs dtype, shape and two data_offsets"));
    }
    SafetensorsEntry entry;
    entry.dtype = dtype->second.string_value();
    const uint64_t element = ElementBytes(entry.dtype);
    if (element == 0) return Bad(path, absl::StrCat(where, "unknown dtype ", entry.dtype));
    uint64_t elements = 1;
    for (const google::protobuf::Value& d : shape->second.list_value().values()) {
      uint64_t n;
      if (!AsCount(d, &n)) return Bad(path, absl::StrCat(where, "bad shape"));
      entry.shape.push_back(static_cast<int64_t>(n));
      elements *= n;
    }
    if (!AsCount(offsets->second.list_value().values(0), &entry.begin) ||
        !AsCount(offsets->second.list_value().values(1), &entry.end) || entry.end < entry.begin ||
        entry.end > data_bytes) {
      return Bad(path, absl::StrCat(where, "data_offsets outside the data"));
    }
    if (entry.end - entry.begin != elements * element) {
      return Bad(path,
                 absl::StrCat(where, entry.end - entry.begin, " bytes do not hold its shape"));
    }
    spans.emplace_back(entry.begin, entry.end);
    index.tensors[name] = std::move(entry);
  }
  std::sort(spans.begin(), spans.end());
  uint64_t covered = 0;
  for (const auto& [begin, end] : spans) {
    if (begin != covered) return Bad(path, "the tensors leave a gap or overlap in the data");
    covered = end;
  }
  if (covered != data_bytes) return Bad(path, "bytes after the last tensor");
  return index;
}

absl::StatusOr<std::string> ReadSafetensorsTensor(const std::string& path,
                                                  const SafetensorsIndex& index,
                                                  const std::string& name) {
  const auto it = index.tensors.find(name);
  if (it == index.tensors.end()) {
    std::vector<std::string> names;
    for (const auto& [n, entry] : index.tensors) names.push_back(n);
    return absl::NotFoundError(absl::StrCat(path, " has no tensor '", name,
                                            "' (it has: ", absl::StrJoin(names, ", "), ")"));
  }
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return PosixError("cannot open", path);
  std::string data(it->second.end - it->second.begin, '\0');
  if (absl::Status s =
          ReadAt(fd.get(), index.data_start + it->second.begin, data.data(), data.size(), path);
      !s.ok()) {
    return s;
  }
  return data;
}

}  // namespace losshead::cli
