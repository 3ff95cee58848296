#include "tests/load/load_util.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace losshead::testing {

absl::StatusOr<std::unique_ptr<server::Server>> StartServer(
    const std::function<void(server::ServerOptions&)>& adjust) {
  server::ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = "";
  options.backend = kernels::BackendKind::kCpu;
  options.worker_threads = 2;
  options.workspace_bytes = size_t{64} << 20;
  options.drain_timeout = absl::Seconds(5);
  if (adjust) adjust(options);
  return server::Server::Start(options);
}

std::unique_ptr<client::Client> Connect(int port, const client::RetryPolicy& retry,
                                        size_t max_message_bytes) {
  client::ClientOptions options;
  options.max_message_bytes = max_message_bytes;
  options.deadline = absl::Seconds(60);
  options.stream_deadline = absl::Seconds(120);
  options.retry = retry;
  // The network path: these tests cut, slam and throttle the TCP connection the tensors travel
  // on (a proxy that counts bytes, dropped connections), which the same-node path bypasses.
  options.same_node = false;
  auto c = client::Client::Connect(absl::StrCat("127.0.0.1:", port), options);
  return c.ok() ? std::move(*c) : nullptr;
}

client::RetryPolicy FastRetries(int max_attempts) {
  client::RetryPolicy p;
  p.max_attempts = max_attempts;
  p.initial_backoff = absl::Milliseconds(1);
  p.max_backoff = absl::Milliseconds(20);
  return p;
}

std::vector<v1::StepRequest> StepMessages(const client::Microbatch& mb, int pieces) {
  std::string data(reinterpret_cast<const char*>(mb.hidden.data()), mb.hidden.size());
  const size_t hidden_bytes = data.size();
  data.append(reinterpret_cast<const char*>(mb.targets.data()), mb.targets.size());
  std::vector<v1::StepRequest> out(std::max(1, pieces));
  v1::StepHeader* h = out[0].mutable_header();
  h->set_head(mb.head);
  h->set_client_id(mb.client_id);
  h->set_sequence(mb.sequence);
  h->set_num_tokens(mb.num_tokens);
  h->set_hidden_dtype(mb.hidden_dtype);
  h->set_target_dtype(mb.target_dtype);
  const size_t per = (data.size() + out.size() - 1) / out.size();
  for (size_t i = 0; i < out.size(); ++i) {
    const size_t begin = std::min(data.size(), i * per);
    const size_t end = std::min(data.size(), begin + per);
    // Split each piece at the hidden / targets boundary.
    if (begin < hidden_bytes) {
      out[i].set_hidden(data.substr(begin, std::min(end, hidden_bytes) - begin));
    }
    if (end > hidden_bytes) {
      const size_t t0 = std::max(begin, hidden_bytes);
      out[i].set_targets(data.substr(t0, end - t0));
    }
  }
  out.back().set_last(true);
  return out;
}

v1::Stats WaitForStats(client::Client& client, const std::function<bool(const v1::Stats&)>& pred,
                       absl::Duration limit) {
  const absl::Time until = absl::Now() + limit;
  v1::Stats last;
  while (absl::Now() < until) {
    auto stats = client.GetStats();
    if (stats.ok()) {
      last = *stats;
      if (pred(last)) return last;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return last;
}

int IdleConnection(int port) {
  static constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\4\0\0\0\0\0";
  constexpr size_t kPrefaceBytes = sizeof(kPreface) - 1;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
      send(fd, kPreface, kPrefaceBytes, MSG_NOSIGNAL) != static_cast<ssize_t>(kPrefaceBytes)) {
    const int error = errno;
    close(fd);
    errno = error;
    return -1;
  }
  return fd;
}

bool ClosedByServer(int fd) {
  char buffer[4096];
  while (true) {
    const ssize_t got = recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (got == 0) return true;
    if (got < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
  }
}

bool WaitClosedByServer(int fd, absl::Duration limit) {
  const absl::Time until = absl::Now() + limit;
  while (!ClosedByServer(fd)) {
    const absl::Duration left = until - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(left), 1, 100)));
  }
  return true;
}

}  // namespace losshead::testing
