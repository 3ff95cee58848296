#include "server/observability/step_trace.h"

#include <cerrno>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace losshead::server {
namespace {

// A JSON string literal. Head names and client ids are the client's text: quotes, backslashes
// and control bytes are escaped; other bytes pass through (JSON readers take UTF-8).
std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (u < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", u);
    } else {
      out.push_back(c);
    }
  }
  out.push_back('"');
  return out;
}

int64_t Micros(absl::Time t) { return t == absl::UnixEpoch() ? 0 : absl::ToUnixMicros(t); }

}  // namespace

absl::StatusOr<std::unique_ptr<StepTrace>> StepTrace::Open(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "a");
  if (file == nullptr) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot open --step_trace file '", path, "'"));
  }
  return std::unique_ptr<StepTrace>(new StepTrace(file));
}

StepTrace::~StepTrace() {
  absl::MutexLock lock(&mu_);
  std::fclose(file_);
}

std::string StepTrace::Format(const StepTraceRecord& r) {
  return absl::StrCat(
      "{\"head\":", JsonString(r.head), ",\"client_id\":", JsonString(r.client_id),
      ",\"sequence\":", r.sequence, ",\"tokens\":", r.tokens, ",\"code\":", r.code,
      ",\"replayed\":", r.replayed ? "true" : "false",
      ",\"first_message_us\":", Micros(r.first_message),
      ",\"last_message_us\":", Micros(r.last_message), ",\"picked_us\":", Micros(r.picked),
      ",\"stage_us\":", Micros(r.stage), ",\"compute_us\":", Micros(r.compute),
      ",\"compute_end_us\":", Micros(r.compute_end), ",\"finish_end_us\":", Micros(r.finish_end),
      ",\"first_send_us\":", Micros(r.first_send), ",\"sent_us\":", Micros(r.sent), "}");
}

void StepTrace::Write(const StepTraceRecord& record) {
  std::string line = Format(record);
  line.push_back('\n');
  absl::MutexLock lock(&mu_);
  std::fwrite(line.data(), 1, line.size(), file_);
  std::fflush(file_);
}

}  // namespace losshead::server
