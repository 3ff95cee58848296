// A minimal HTTP/1.1 endpoint that serves the Prometheus text exposition at GET /metrics.
//
// The server owns this instead of prometheus-cpp's civetweb Exposer: civetweb starts its threads
// with a fixed 100 KiB stack, and once cuBLAS is loaded the process's static TLS alone is larger
// than that, so every civetweb thread fails to start in a CUDA build. One plain thread with the
// default stack serves scrapes one at a time, which is all Prometheus needs.
#ifndef LOSSHEAD_SERVER_OBSERVABILITY_METRICS_ENDPOINT_H_
#define LOSSHEAD_SERVER_OBSERVABILITY_METRICS_ENDPOINT_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace losshead::server {

class MetricsEndpoint {
 public:
  // Renders the exposition body; called once per scrape on the endpoint's thread.
  using Renderer = std::function<std::string()>;

  // Binds `address` ("host:port", IPv4 or [IPv6]; port 0 picks a free one) and starts serving.
  // UNAVAILABLE if the address cannot be resolved or bound; INVALID_ARGUMENT if it is malformed.
  // With `basic_auth` ("user:password"), a request without those credentials in an
  // `Authorization: Basic` header is answered 401 with a WWW-Authenticate challenge; the
  // credentials are compared in constant time (SHA-256 digests, CRYPTO_memcmp).
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& address, Renderer render,
      std::optional<std::string> basic_auth = std::nullopt);

  // Stops accepting, finishes the scrape in progress (bounded by its socket timeouts) and joins.
  ~MetricsEndpoint();

  int port() const { return port_; }

 private:
  MetricsEndpoint(int listen_fd, int wake_fd_read, int wake_fd_write, int port, Renderer render,
                  std::optional<std::string> basic_auth_digest);
  void Serve();
  void HandleConnection(int fd);

  const int listen_fd_;
  const int wake_read_fd_;   // the serving thread polls it to learn of shutdown at once
  const int wake_write_fd_;
  const int port_;
  const Renderer render_;
  // SHA-256 of "user:password" when basic auth is on.
  const std::optional<std::string> basic_auth_digest_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_OBSERVABILITY_METRICS_ENDPOINT_H_
