// Reads a Prometheus text exposition over plain HTTP and answers questions about its samples.
#ifndef LOSSHEAD_TESTS_SERVICE_METRICS_SCRAPE_H_
#define LOSSHEAD_TESTS_SERVICE_METRICS_SCRAPE_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace losshead::testing {

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct Exposition {
  std::map<std::string, std::string> types;  // family name -> counter | gauge | histogram | ...
  std::vector<Sample> samples;

  // Sum of the samples named `name` whose labels include all of `labels`.
  double Sum(const std::string& name, const std::map<std::string, std::string>& labels = {}) const;
  // Samples named `name` whose labels include all of `labels`.
  std::vector<Sample> Find(const std::string& name,
                           const std::map<std::string, std::string>& labels = {}) const;
};

// GET http://127.0.0.1:<port><path> with HTTP/1.0 (no chunked encoding); the body on status 200.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);
absl::StatusOr<Exposition> ParseExposition(const std::string& text);
// The sum of the samples named `name` with `labels` at `port` now; a failed scrape is a test
// failure (EXPECT) and reads as -1.
double ScrapeSum(int port, const std::string& name,
                 const std::map<std::string, std::string>& labels = {});
// The /metrics exposition at `port` once the samples named `name` with `labels` sum to at least
// `at_least`, read every 10 ms (a call is counted once the server is done with it, which may come
// after the client saw its status); DEADLINE_EXCEEDED with the last body after `timeout`.
absl::StatusOr<Exposition> ScrapeWhen(int port, const std::string& name,
                                      const std::map<std::string, std::string>& labels,
                                      double at_least, absl::Duration timeout = absl::Seconds(20));

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_SERVICE_METRICS_SCRAPE_H_
