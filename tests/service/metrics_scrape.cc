#include "tests/service/metrics_scrape.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/common/http_exchange.h"

namespace losshead::testing {
namespace {

bool Matches(const Sample& s, const std::map<std::string, std::string>& labels) {
  for (const auto& [key, value] : labels) {
    auto it = s.labels.find(key);
    if (it == s.labels.end() || it->second != value) return false;
  }
  return true;
}

// name{k="v",...} value [timestamp]
absl::StatusOr<Sample> ParseSample(absl::string_view line) {
  Sample s;
  size_t i = 0;
  while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
  s.name = std::string(line.substr(0, i));
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (i < line.size() && line[i] != '}') {
      const size_t eq = line.find('=', i);
      if (eq == absl::string_view::npos || eq + 1 >= line.size() || line[eq + 1] != '"') {
        return absl::InvalidArgumentError(absl::StrCat("bad labels: ", line));
      }
      std::string key(line.substr(i, eq - i));
      std::string value;
      size_t j = eq + 2;
      for (; j < line.size() && line[j] != '"'; ++j) {
        if (line[j] == '\\' && j + 1 < line.size()) {
          ++j;
          value.push_back(line[j] == 'n' ? '\n' : line[j]);
        } else {
          value.push_back(line[j]);
        }
      }
      if (j >= line.size()) return absl::InvalidArgumentError(absl::StrCat("bad labels: ", line));
      s.labels[key] = value;
      i = j + 1;
      if (i < line.size() && line[i] == ',') ++i;
    }
    if (i >= line.size()) return absl::InvalidArgumentError(absl::StrCat("unclosed {: ", line));
    ++i;
  }
  absl::string_view rest = absl::StripLeadingAsciiWhitespace(line.substr(i));
  std::vector<absl::string_view> fields = absl::StrSplit(rest, ' ', absl::SkipEmpty());
  if (fields.empty()) return absl::InvalidArgumentError(absl::StrCat("no value: ", line));
  if (fields[0] == "+Inf") {
    s.value = INFINITY;
  } else if (fields[0] == "-Inf") {
    s.value = -INFINITY;
  } else if (fields[0] == "NaN") {
    s.value = NAN;
  } else if (!absl::SimpleAtod(fields[0], &s.value)) {
    return absl::InvalidArgumentError(absl::StrCat("bad value: ", line));
  }
  return s;
}

}  // namespace

double Exposition::Sum(const std::string& name,
                       const std::map<std::string, std::string>& labels) const {
  double sum = 0;
  for (const Sample& s : samples) {
    if (s.name == name && Matches(s, labels)) sum += s.value;
  }
  return sum;
}

std::vector<Sample> Exposition::Find(const std::string& name,
                                     const std::map<std::string, std::string>& labels) const {
  std::vector<Sample> out;
  for (const Sample& s : samples) {
    if (s.name == name && Matches(s, labels)) out.push_back(s);
  }
  return out;
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  absl::StatusOr<std::string> answer =
      HttpExchange(port, absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"));
  if (!answer.ok()) return answer.status();
  const std::string& response = *answer;
  const size_t end = response.find("\r\n\r\n");
  if (end == std::string::npos) return absl::InternalError("no HTTP header end");
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (status_line.find(" 200") == std::string::npos) {
    return absl::InternalError(absl::StrCat("HTTP status: ", status_line));
  }
  return response.substr(end + 4);
}

absl::StatusOr<Exposition> ParseExposition(const std::string& text) {
  Exposition e;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    line = absl::StripTrailingAsciiWhitespace(line);
    if (line.empty()) continue;
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (parts.size() == 2) e.types[parts[0]] = parts[1];
      continue;
    }
    if (line[0] == '#') continue;
    auto sample = ParseSample(line);
    if (!sample.ok()) return sample.status();
    e.samples.push_back(std::move(*sample));
  }
  return e;
}

absl::StatusOr<Exposition> ScrapeWhen(int port, const std::string& name,
                                      const std::map<std::string, std::string>& labels,
                                      double at_least, absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  for (;;) {
    absl::StatusOr<std::string> body = HttpGet(port, "/metrics");
    if (!body.ok()) return body.status();
    absl::StatusOr<Exposition> e = ParseExposition(*body);
    if (!e.ok() || e->Sum(name, labels) >= at_least) return e;
    if (absl::Now() >= give_up) {
      return absl::DeadlineExceededError(
          absl::StrCat(name, " stayed below ", at_least, " for ", absl::FormatDuration(timeout),
                       "; the last exposition:\n", *body));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

double ScrapeSum(int port, const std::string& name,
                 const std::map<std::string, std::string>& labels) {
  auto body = HttpGet(port, "/metrics");
  EXPECT_TRUE(body.ok()) << body.status();
  if (!body.ok()) return -1;
  auto e = ParseExposition(*body);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? e->Sum(name, labels) : -1;
}

}  // namespace losshead::testing
