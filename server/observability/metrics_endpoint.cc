#include "server/observability/metrics_endpoint.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace losshead::server {
namespace {

// A scrape request is a few hundred bytes; anything longer is not a scrape.
constexpr size_t kMaxRequestBytes = 8192;
// A client that stalls mid-request or mid-response cannot hold the endpoint longer than this.
constexpr int kSocketTimeoutSeconds = 5;

bool SplitHostPort(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  return true;
}

void SendAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the scraper went away; nothing to recover
    sent += static_cast<size_t>(n);
  }
}

std::string Response(absl::string_view status, absl::string_view content_type,
                     absl::string_view body, absl::string_view extra_headers = "") {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                      "Connection: close\r\n\r\n", body);
}

std::string Sha256(absl::string_view text) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

// The decoded credentials of the request's `Authorization: Basic` header; empty when absent.
std::string BasicCredentials(absl::string_view request) {
  const size_t headers_end = request.find("\r\n\r\n");
  absl::string_view headers = request.substr(0, headers_end);
  size_t pos = headers.find('\n');
  while (pos != absl::string_view::npos) {
    const size_t next = headers.find('\n', pos + 1);
    absl::string_view line = headers.substr(pos + 1, next == absl::string_view::npos
                                                         ? absl::string_view::npos
                                                         : next - pos - 1);
    pos = next;
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos ||
        !absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(line.substr(0, colon)),
                                "authorization")) {
      continue;
    }
    absl::string_view value = absl::StripAsciiWhitespace(line.substr(colon + 1));
    if (value.size() < 6 || !absl::EqualsIgnoreCase(value.substr(0, 6), "basic ")) return "";
    std::string decoded;
    if (!absl::Base64Unescape(absl::StripAsciiWhitespace(value.substr(6)), &decoded)) return "";
    return decoded;
  }
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& address, Renderer render, std::optional<std::string> basic_auth) {
  if (basic_auth.has_value() && basic_auth->find(':') == std::string::npos) {
    return absl::InvalidArgumentError("metrics basic auth must be 'user:password'");
  }
  std::string host, port_text;
  int port_number = 0;
  if (!SplitHostPort(address, &host, &port_text) || !absl::SimpleAtoi(port_text, &port_number) ||
      port_number < 0 || port_number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address must be host:port, got '", address, "'"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* resolved = nullptr;
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints,
                               &resolved);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve metrics address '", address, "': ", gai_strerror(rc)));
  }
  int fd = -1;
  std::string last_error = "no address";
  for (addrinfo* ai = resolved; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, 16) != 0) {
      last_error = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(resolved);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", last_error));
  }
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bound_len);
  const int bound_port = ntohs(bound.ss_family == AF_INET6
                                   ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                   : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC) != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  std::optional<std::string> digest;
  if (basic_auth.has_value()) digest = Sha256(*basic_auth);
  return std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint(
      fd, wake[0], wake[1], bound_port, std::move(render), std::move(digest)));
}

MetricsEndpoint::MetricsEndpoint(int listen_fd, int wake_fd_read, int wake_fd_write, int port,
                                 Renderer render, std::optional<std::string> basic_auth_digest)
    : listen_fd_(listen_fd),
      wake_read_fd_(wake_fd_read),
      wake_write_fd_(wake_fd_write),
      port_(port),
      render_(std::move(render)),
      basic_auth_digest_(std::move(basic_auth_digest)) {
  thread_ = std::thread([this] { Serve(); });
}

MetricsEndpoint::~MetricsEndpoint() {
  stopping_.store(true);
  const char byte = 0;
  (void)!::write(wake_write_fd_, &byte, 1);
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_read_fd_);
  ::close(wake_write_fd_);
}

void MetricsEndpoint::Serve() {
  while (!stopping_.load()) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    HandleConnection(fd);
    ::close(fd);
  }
}

void MetricsEndpoint::HandleConnection(int fd) {
  timeval timeout{kSocketTimeoutSeconds, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  std::string request;
  char buffer[1024];
  while (!absl::StrContains(request, "\r\n\r\n") && !absl::StrContains(request, "\n\n")) {
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    request.append(buffer, static_cast<size_t>(n));
    if (request.size() > kMaxRequestBytes) {
      SendAll(fd, Response("431 Request Header Fields Too Large", "text/plain", "too large\n"));
      return;
    }
  }
  const absl::string_view line(request.data(), request.find_first_of("\r\n"));
  const size_t method_end = line.find(' ');
  const size_t target_end = line.find(' ', method_end + 1);
  if (method_end == absl::string_view::npos || target_end == absl::string_view::npos) {
    SendAll(fd, Response("400 Bad Request", "text/plain", "bad request line\n"));
    return;
  }
  const absl::string_view method = line.substr(0, method_end);
  absl::string_view target = line.substr(method_end + 1, target_end - method_end - 1);
  target = target.substr(0, target.find('?'));
  if (target != "/metrics") {
    SendAll(fd, Response("404 Not Found", "text/plain", "see /metrics\n"));
    return;
  }
  if (basic_auth_digest_.has_value()) {
    // Digests have one length whatever was sent, so CRYPTO_memcmp's time tells nothing about how
    // much of the password matched.
    const std::string presented = Sha256(BasicCredentials(request));
    if (CRYPTO_memcmp(presented.data(), basic_auth_digest_->data(), presented.size()) != 0) {
      SendAll(fd, Response("401 Unauthorized", "text/plain", "authentication required\n",
                           "WWW-Authenticate: Basic realm=\"losshead metrics\"\r\n"));
      return;
    }
  }
  if (method != "GET" && method != "HEAD") {
    SendAll(fd, Response("405 Method Not Allowed", "text/plain", "GET only\n"));
    return;
  }
  const std::string body = render_();
  std::string response = Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", body);
  if (method == "HEAD") response.resize(response.size() - body.size());
  SendAll(fd, response);
}

}  // namespace losshead::server
