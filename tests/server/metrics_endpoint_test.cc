#include "server/metrics_endpoint.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace losshead::server {
namespace {

// Sends `request` verbatim to 127.0.0.1:port and returns everything the endpoint answers.
std::string Exchange(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0) response.append(buffer, n);
  ::close(fd);
  return response;
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
