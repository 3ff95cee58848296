#include "server/observability/metrics_endpoint.h"

#include <atomic>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/common/http_exchange.h"

namespace losshead::server {
namespace {

// Everything the endpoint answers to `request`; empty when the exchange fails.
std::string Exchange(int port, const std::string& request) {
  return testing::HttpExchange(port, request).value_or("");
}

TEST(MetricsEndpointTest, ServesRenderedBodyOnGetMetricsOnly) {
  std::atomic<int> renders{0};
  auto endpoint = MetricsEndpoint::Start("127.0.0.1:0", [&renders] {
    return absl::StrCat("probe_renders ", ++renders, "\n");
  });
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int port = (*endpoint)->port();
  ASSERT_GT(port, 0);

  const std::string ok = Exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_TRUE(absl::StartsWith(ok, "HTTP/1.1 200 OK\r\n")) << ok;
  EXPECT_TRUE(absl::StrContains(ok, "Content-Type: text/plain; version=0.0.4")) << ok;
  EXPECT_TRUE(absl::EndsWith(ok, "\r\n\r\nprobe_renders 1\n")) << ok;
  // Every scrape renders afresh.
  EXPECT_TRUE(absl::EndsWith(Exchange(port, "GET /metrics?x=1 HTTP/1.0\r\n\r\n"), "renders 2\n"));

  EXPECT_TRUE(absl::StartsWith(Exchange(port, "GET / HTTP/1.1\r\n\r\n"), "HTTP/1.1 404"));
  EXPECT_TRUE(absl::StartsWith(Exchange(port, "POST /metrics HTTP/1.1\r\n\r\n"), "HTTP/1.1 405"));
  EXPECT_TRUE(absl::StartsWith(Exchange(port, "garbage\r\n\r\n"), "HTTP/1.1 400"));
  EXPECT_TRUE(absl::StartsWith(Exchange(port, std::string(10000, 'a')), "HTTP/1.1 431"));
  EXPECT_EQ(renders.load(), 2);
}

TEST(MetricsEndpointTest, RejectsMalformedAndTakenAddresses) {
  auto render = [] { return std::string(); };
  EXPECT_EQ(MetricsEndpoint::Start("no-port", render).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsEndpoint::Start("127.0.0.1:99999", render).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto first = MetricsEndpoint::Start("127.0.0.1:0", render);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(MetricsEndpoint::Start(absl::StrCat("127.0.0.1:", (*first)->port()), render)
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace losshead::server
