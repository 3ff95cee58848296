// Idle connections against a server process that may hold only 256 descriptors: more raw TCP
// connections than that, each sending the HTTP/2 preface and nothing else, must neither lock out
// a client with a valid token (it is served at once, its micro-batch checked against the float64
// reference) nor stay open (each is closed at the latest --first_call_timeout after its accept).
// Default limits otherwise: --max_connections is derived from the descriptor limit.
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "tests/common/server_process.h"
#include "tests/load/load_util.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

#ifndef LOSSHEAD_SERVER_BINARY
#error "LOSSHEAD_SERVER_BINARY must name the losshead-server executable"
#endif

namespace losshead::testing {
namespace {

constexpr uint64_t kOpenFiles = 256;
constexpr int kIdleConnections = 400;  // more than the server's descriptors
constexpr char kWriterToken[] = "writer-token-for-descriptor-test";

// The metrics port the server logged ("metrics on http://127.0.0.1:PORT/metrics"); 0 if none yet.
int MetricsPort(const std::string& log_path) {
  const std::string log = ReadText(log_path);
  const std::string marker = "metrics on http://127.0.0.1:";
  const size_t at = log.find(marker);
  if (at == std::string::npos) return 0;
  const size_t end = log.find('/', at + marker.size());
  int port = 0;
  if (end == std::string::npos ||
      !absl::SimpleAtoi(log.substr(at + marker.size(), end - at - marker.size()), &port)) {
    return 0;
  }
  return port;
}

class DescriptorLimitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // This process holds the idle connections: let it have the descriptors for them.
    rlimit limit{};
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
    dir_ = absl::StrCat(::testing::TempDir(), "/descriptor_limit_test.", getpid());
    std::filesystem::create_directories(dir_);
    std::ofstream(dir_ + "/tokens") << "writer " << kWriterToken << "\n";
  }
  void TearDown() override {
    for (int fd : idle_) {
      if (fd >= 0) close(fd);
    }
    std::filesystem::remove_all(dir_);
  }

  std::string dir_;
  std::vector<int> idle_;
};

TEST_F(DescriptorLimitTest, IdleConnectionsNeitherLockOutATokenHolderNorStayOpen) {
  const std::string log = dir_ + "/server.log";
  std::remove(log.c_str());
  auto server = ServerProcess::Start(
      LOSSHEAD_SERVER_BINARY,
      {"--backend=cpu", "--metrics_listen=127.0.0.1:0",
       absl::StrCat("--auth_tokens_file=", dir_, "/tokens"),
       // Shorter than the default 10 s, so that the test waits 2 s for the reaping.
       "--first_call_timeout=2s"},
      log, SpawnOptions{.open_files_limit = kOpenFiles});
  ASSERT_TRUE(server.ok()) << server.status();
  int metrics = 0;
  for (absl::Time until = absl::Now() + absl::Seconds(10); metrics == 0 && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(10));
    metrics = MetricsPort(log);
  }
  ASSERT_GT(metrics, 0) << ReadText(log);

  const absl::Time flood_start = absl::Now();
  for (int i = 0; i < kIdleConnections; ++i) {
    const int fd = IdleConnection((*server)->port());
    ASSERT_GE(fd, 0) << "connection " << i << ": " << std::strerror(errno);
    idle_.push_back(fd);
  }

  // A call without a token is refused and proves nothing: its connection goes like the idle ones.
  auto anonymous = v1::LossHead::NewStub(
      grpc::CreateChannel((*server)->target(), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::Stats stats;
    EXPECT_EQ(anonymous->GetStats(&context, v1::GetStatsRequest(), &stats).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }

  // The token holder is served at once, while the idle connections are still open.
  client::ClientOptions options;
  options.bearer_token = kWriterToken;
  options.deadline = absl::Seconds(5);
  auto writer = client::Client::Connect((*server)->target(), options);
  ASSERT_TRUE(writer.ok()) << writer.status();
  constexpr int64_t kV = 37, kD = 16, kN = 24;
  auto head = CreateKnownHead(**writer, "served", kV, kD, v1::DTYPE_FP32, 11);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 12);
  auto result = (*writer)->Step(ToMicrobatch(head->name, "writer", 1, batch));
  ASSERT_TRUE(result.ok()) << result.status();
  const absl::Duration served_after = absl::Now() - flood_start;
  const RefResult want = Reference(head->weight, batch.hidden, batch.targets, kN, kD, kV, {});
  const Tolerance tol = ToleranceFor(v1::DTYPE_FP32);
  EXPECT_NEAR(result->loss, want.loss, tol.loss_rel * std::max(1.0, std::fabs(want.loss)));
  EXPECT_TRUE(AllClose(Decode(result->grad_hidden, v1::DTYPE_FP32), want.grad_hidden, tol.grad));
  EXPECT_LT(served_after, absl::Seconds(5));

  // Every idle connection is closed by the server: the oldest at once to make room, the rest
  // 2 s after their accept.
  int closed = 0;
  for (absl::Time until = absl::Now() + absl::Seconds(10);
       closed < kIdleConnections && absl::Now() < until;) {
    std::vector<pollfd> open;
    for (int fd : idle_) {
      if (fd >= 0) open.push_back({fd, POLLIN, 0});
    }
    poll(open.data(), open.size(), 100);
    for (int& fd : idle_) {
      if (fd >= 0 && ClosedByServer(fd)) {
        close(fd);
        fd = -1;
        ++closed;
      }
    }
  }
  EXPECT_EQ(closed, kIdleConnections);

  // The writer's connection made calls: it stays, and the next call needs no new connection.
  const double accepted = ScrapeSum(metrics, "losshead_connections_accepted_total", {});
  auto info = (*writer)->GetHead(head->name);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->microbatches_total(), 1u);
  EXPECT_EQ(ScrapeSum(metrics, "losshead_connections_accepted_total", {}), accepted);
  // The anonymous caller's connection was accepted after the idle ones, so its own
  // --first_call_timeout may end a moment after the last of theirs: wait for it, within a bound.
  double open = ScrapeSum(metrics, "losshead_connections_open", {});
  double reaped = ScrapeSum(metrics, "losshead_connections_reaped_total", {});
  for (absl::Time until = absl::Now() + absl::Seconds(5);
       (open != 1 || reaped < kIdleConnections + 1) && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(50));
    open = ScrapeSum(metrics, "losshead_connections_open", {});
    reaped = ScrapeSum(metrics, "losshead_connections_reaped_total", {});
  }
  EXPECT_EQ(open, 1);
  // The idle ones and the anonymous caller's were reaped: displaced or timed out. (Connections
  // a client dropped by itself, as gRPC 1.51's may after a failed connect, are not counted.)
  EXPECT_GE(reaped, kIdleConnections + 1);
  EXPECT_LE(reaped, accepted - 1);
  EXPECT_GT(ScrapeSum(metrics, "losshead_connections_reaped_total", {{"reason", "displaced"}}), 0);
  EXPECT_GT(
      ScrapeSum(metrics, "losshead_connections_reaped_total", {{"reason", "first_call_timeout"}}), 0);
  EXPECT_EQ(ScrapeSum(metrics, "losshead_connections_refused_total", {}), 0);
  EXPECT_TRUE((*server)->Running());
}

}  // namespace
}  // namespace losshead::testing
