// A client whose first connection attempt fails reaches the server with its own retries: the
// channel tries to connect again after 100 ms, not after gRPC's default 1 s, which is longer than
// the default retry policy's waits together (50 + 100 + 200 + 400 ms).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

// A loopback port nothing listens on now: bound once to learn it, then released.
int UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

TEST(ReconnectTest, RetriesReachAServerThatListensOnlyAfterTheFirstAttemptFailed) {
  const int port = UnusedPort();
  ASSERT_GT(port, 0);
  const std::string target = absl::StrCat("127.0.0.1:", port);
  auto client = client::Client::Connect(target, client::ClientOptions());
  ASSERT_TRUE(client.ok()) << client.status();

  // The server starts once the client's first attempt has failed (connection refused) and it is
  // waiting to retry.
  std::unique_ptr<TestServer> server;
  absl::Status started;
  std::thread starter([&] {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((*client)->retries() == 0 && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    server::ServerOptions options = TestServer::Options();
    options.listen_address = target;
    auto s = TestServer::StartWith(options);
    started = s.status();
    if (s.ok()) server = *std::move(s);
  });
  absl::StatusOr<std::vector<v1::HeadInfo>> heads = (*client)->ListHeads();
  starter.join();
  ASSERT_TRUE(started.ok()) << started;
  EXPECT_TRUE(heads.ok()) << heads.status();
  EXPECT_GE((*client)->retries(), 1u);
}

}  // namespace
}  // namespace losshead::testing
