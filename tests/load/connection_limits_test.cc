// The connection limits of the gRPC TCP port (server/rpc/connection_guard.h): at
// --max_connections a new connection displaces the oldest one that made no call, or is refused
// when all have; connections that make no accepted call (with tokens: no call with a valid token)
// are closed after --first_call_timeout; a connection with an open Step stream is never idle, and
// an idle one closed by --max_connection_idle is reopened by its client at the next call.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "server/rpc/connection_guard.h"
#include "tests/load/load_util.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr char kWriterToken[] = "writer-token-for-connection-tests";

class ConnectionLimitsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (int fd : raw_) {
      if (fd >= 0) close(fd);
    }
  }

  void Start(const std::function<void(server::ServerOptions&)>& adjust) {
    auto s = StartServer([&](server::ServerOptions& o) {
      o.metrics_address = "127.0.0.1:0";
      adjust(o);
    });
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }
  std::string Target() const { return absl::StrCat("127.0.0.1:", server_->port()); }

  double Scrape(const std::string& name, const std::map<std::string, std::string>& labels = {}) {
    return ScrapeSum(server_->metrics_port(), name, labels);
  }
  // Polls the metric until it equals `want` (the guard updates it on its own thread).
  double AwaitMetric(const std::string& name, double want,
                     const std::map<std::string, std::string>& labels = {}) {
    double got = Scrape(name, labels);
    for (absl::Time until = absl::Now() + absl::Seconds(10); got != want && absl::Now() < until;) {
      absl::SleepFor(absl::Milliseconds(10));
      got = Scrape(name, labels);
    }
    return got;
  }

  int OpenRaw() {
    const int fd = IdleConnection(server_->port());
    EXPECT_GE(fd, 0) << std::strerror(errno);
    raw_.push_back(fd);
    return fd;
  }

  // A client on a connection of its own.
  std::unique_ptr<client::Client> NewClient(const std::string& token = "") {
    client::ClientOptions options;
    options.dedicated_connection = true;
    options.bearer_token = token;
    options.deadline = absl::Seconds(10);
    auto c = client::Client::Connect(Target(), options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  std::unique_ptr<server::Server> server_;
  std::vector<int> raw_;
};

TEST_F(ConnectionLimitsTest, ANewConnectionDisplacesTheOldestThatMadeNoCall) {
  Start([](server::ServerOptions& o) {
    o.max_connections = 4;
    o.first_call_timeout = absl::Minutes(1);  // only displacement closes connections here
  });
  auto client = NewClient();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->GetStats().ok());  // a call: its connection is never displaced
  // (gRPC 1.51's client may have opened and dropped a connection first: see client.cc.)
  ASSERT_EQ(AwaitMetric("losshead_connections_open", 1), 1);
  const double accepted = Scrape("losshead_connections_accepted_total");
  std::vector<int> fds;
  for (int i = 0; i < 3; ++i) fds.push_back(OpenRaw());
  EXPECT_EQ(AwaitMetric("losshead_connections_open", 4), 4);
  // Two more: the two oldest raw ones make room, in accept order.
  fds.push_back(OpenRaw());
  EXPECT_TRUE(WaitClosedByServer(fds[0], absl::Seconds(5)));
  fds.push_back(OpenRaw());
  EXPECT_TRUE(WaitClosedByServer(fds[1], absl::Seconds(5)));
  for (size_t i = 2; i < fds.size(); ++i) EXPECT_FALSE(ClosedByServer(fds[i])) << i;
  // (The metrics change just after the socket is shut down: wait for them.)
  EXPECT_EQ(AwaitMetric("losshead_connections_reaped_total", 2, {{"reason", "displaced"}}), 2);
  EXPECT_EQ(AwaitMetric("losshead_connections_accepted_total", accepted + 5), accepted + 5);
  EXPECT_EQ(AwaitMetric("losshead_connections_open", 4), 4);
  // The client's connection is the one that stayed: its next call needs no new one.
  ASSERT_TRUE(client->GetStats().ok());
  EXPECT_EQ(Scrape("losshead_connections_accepted_total"), accepted + 5);
}

TEST_F(ConnectionLimitsTest, WhenEveryConnectionMadeACallANewOneIsRefused) {
  Start([](server::ServerOptions& o) { o.max_connections = 2; });
  auto a = NewClient();
  auto b = NewClient();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(a->GetStats().ok());
  ASSERT_TRUE(b->GetStats().ok());
  ASSERT_EQ(AwaitMetric("losshead_connections_open", 2), 2);
  const double accepted = Scrape("losshead_connections_accepted_total");
  const int refused = OpenRaw();
  EXPECT_TRUE(WaitClosedByServer(refused, absl::Seconds(5)));
  EXPECT_EQ(AwaitMetric("losshead_connections_refused_total", 1), 1);
  EXPECT_EQ(Scrape("losshead_connections_open"), 2);
  // Both clients go on, on their connections.
  EXPECT_TRUE(a->GetStats().ok());
  EXPECT_TRUE(b->GetStats().ok());
  EXPECT_EQ(Scrape("losshead_connections_accepted_total"), accepted);
}

TEST_F(ConnectionLimitsTest, WithTokensOnlyACallWithAValidTokenKeepsAConnection) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/connection_limits_tokens.", getpid());
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokens") << "writer " << kWriterToken << "\n";
  Start([&](server::ServerOptions& o) {
    o.auth_tokens_file = dir + "/tokens";
    o.first_call_timeout = absl::Seconds(1);
  });
  auto writer = NewClient(kWriterToken);
  ASSERT_NE(writer, nullptr);
  ASSERT_TRUE(writer->GetStats().ok());
  // A health probe (no token needed) and a call without a token: neither proves its connection.
  auto prober = NewClient();
  ASSERT_NE(prober, nullptr);
  auto health = prober->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  auto anonymous = NewClient();
  ASSERT_NE(anonymous, nullptr);
  EXPECT_EQ(anonymous->GetStats().status().code(), absl::StatusCode::kUnauthenticated);
  const int raw = OpenRaw();

  EXPECT_TRUE(WaitClosedByServer(raw, absl::Seconds(5)));
  EXPECT_EQ(AwaitMetric("losshead_connections_reaped_total", 3, {{"reason", "first_call_timeout"}}),
            3);
  EXPECT_EQ(AwaitMetric("losshead_connections_open", 1), 1);
  const double accepted = Scrape("losshead_connections_accepted_total");
  // The writer's connection outlived the timeout; the prober's reconnects for its next probe.
  absl::SleepFor(absl::Milliseconds(1100));
  ASSERT_TRUE(writer->GetStats().ok());
  EXPECT_EQ(Scrape("losshead_connections_accepted_total"), accepted);
  health = prober->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(Scrape("losshead_connections_accepted_total"), accepted + 1);
}

TEST_F(ConnectionLimitsTest, WithoutTokensAnyCallKeepsAConnection) {
  Start([](server::ServerOptions& o) { o.first_call_timeout = absl::Seconds(1); });
  auto prober = NewClient();
  ASSERT_NE(prober, nullptr);
  ASSERT_TRUE(prober->Health().ok());
  ASSERT_EQ(AwaitMetric("losshead_connections_open", 1), 1);
  const double accepted = Scrape("losshead_connections_accepted_total");
  const int raw = OpenRaw();
  EXPECT_TRUE(WaitClosedByServer(raw, absl::Seconds(5)));
  EXPECT_EQ(AwaitMetric("losshead_connections_open", 1), 1);
  ASSERT_TRUE(prober->Health().ok());
  EXPECT_EQ(Scrape("losshead_connections_accepted_total"), accepted + 1);
  EXPECT_EQ(AwaitMetric("losshead_connections_reaped_total", 1, {{"reason", "first_call_timeout"}}),
            1);
}

TEST_F(ConnectionLimitsTest, AnOpenStepStreamIsNeverIdleAndAnIdleConnectionIsReopened) {
  Start([](server::ServerOptions& o) { o.max_connection_idle = absl::Milliseconds(300); });
  auto client = NewClient();
  ASSERT_NE(client, nullptr);
  constexpr int64_t kV = 29, kD = 8, kN = 10;
  auto head = CreateKnownHead(*client, "idle", kV, kD, v1::DTYPE_FP32, 3);
  ASSERT_TRUE(head.ok()) << head.status();
  const double accepted = Scrape("losshead_connections_accepted_total");

  // One Step stream, its micro-batches a second apart: the idle limit never ends it.
  auto stub =
      v1::LossHead::NewStub(grpc::CreateChannel(Target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->Step(&context);
  for (uint64_t sequence = 1; sequence <= 3; ++sequence) {
    if (sequence > 1) absl::SleepFor(absl::Seconds(1));
    const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 40 + sequence);
    for (const v1::StepRequest& r :
         StepMessages(ToMicrobatch(head->name, "stream", sequence, batch), 1)) {
      ASSERT_TRUE(stream->Write(r)) << sequence;
    }
    v1::StepResponse first;
    ASSERT_TRUE(stream->Read(&first)) << sequence;
    ASSERT_TRUE(first.has_result()) << first.DebugString();
    const RefResult want = Reference(head->weight, batch.hidden, batch.targets, kN, kD, kV, {});
    const Tolerance tol = ToleranceFor(v1::DTYPE_FP32);
    EXPECT_NEAR(first.result().loss(), want.loss,
                tol.loss_rel * std::max(1.0, std::fabs(want.loss)));
    for (v1::StepResponse more = first; !more.last();) ASSERT_TRUE(stream->Read(&more));
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(Scrape("losshead_connections_accepted_total"), accepted + 1);

  // The client's connection had no call for two seconds: gRPC closed it, and the next call
  // reconnects on its own.
  auto info = client->GetHead(head->name);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->microbatches_total(), 3u);
  EXPECT_GE(Scrape("losshead_connections_accepted_total"), accepted + 2);
}

// Whether this host can bind the IPv6 loopback.
bool HasIpv6Loopback() {
  const int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in6 addr{};
  addr.sin6_family = AF_INET6;
  addr.sin6_addr = in6addr_loopback;
  const bool ok = bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

TEST_F(ConnectionLimitsTest, AWildcardAddressServesIpv4AndIpv6ClientsAndKnowsTheirCalls) {
  Start([](server::ServerOptions& o) {
    o.listen_address = "0.0.0.0:0";
    o.first_call_timeout = absl::Seconds(1);
  });
  std::vector<std::string> targets = {Target()};
  // gRPC's own listener takes IPv6 too on a wildcard address (dual stack), and so does this one.
  if (HasIpv6Loopback()) targets.push_back(absl::StrCat("[::1]:", server_->port()));
  std::vector<std::unique_ptr<client::Client>> clients;
  for (const std::string& target : targets) {
    client::ClientOptions options;
    options.dedicated_connection = true;
    auto c = client::Client::Connect(target, options);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->GetStats().ok()) << target;
    clients.push_back(std::move(*c));
  }
  // Their calls proved their connections, whichever family the peer's address has.
  ASSERT_EQ(AwaitMetric("losshead_connections_open", clients.size()), clients.size());
  const double accepted = Scrape("losshead_connections_accepted_total");
  absl::SleepFor(absl::Milliseconds(1200));
  for (auto& c : clients) EXPECT_TRUE(c->GetStats().ok());
  EXPECT_EQ(Scrape("losshead_connections_accepted_total"), accepted);
  EXPECT_EQ(Scrape("losshead_connections_reaped_total"), 0);
}

TEST(ConnectionGuardTest, PeerKeysMatchTheAddressesGrpcNames) {
  using server::PeerKeyOfUri;
  const auto v4 = PeerKeyOfUri("ipv4:127.0.0.1:5000");
  ASSERT_TRUE(v4.has_value());
  EXPECT_EQ(PeerKeyOfUri("ipv6:[::ffff:127.0.0.1]:5000"), v4);  // IPv4 mapped into IPv6
  EXPECT_EQ(PeerKeyOfUri("ipv6:%5B::ffff:127.0.0.1%5D:5000"), v4);
  EXPECT_NE(PeerKeyOfUri("ipv4:127.0.0.1:5001"), v4);
  EXPECT_NE(PeerKeyOfUri("ipv4:127.0.0.2:5000"), v4);
  const auto v6 = PeerKeyOfUri("ipv6:[::1]:7");
  ASSERT_TRUE(v6.has_value());
  EXPECT_EQ(PeerKeyOfUri("ipv6:%5B::1%5D:7"), v6);
  EXPECT_TRUE(PeerKeyOfUri("ipv6:%5Bfe80::1%25eth0%5D:7").has_value());
  EXPECT_FALSE(PeerKeyOfUri("unix:/tmp/socket").has_value());
  EXPECT_FALSE(PeerKeyOfUri("ipv4:127.0.0.1").has_value());
  EXPECT_FALSE(PeerKeyOfUri("ipv4:not-an-address:1").has_value());
}

TEST(ConnectionGuardTest, TheDefaultLimitLeavesDescriptorsForEverythingElse) {
  using server::DefaultMaxConnections;
  EXPECT_EQ(DefaultMaxConnections(256), 96u);          // (256 - 64) / 2
  EXPECT_EQ(DefaultMaxConnections(1024), 384u);        // (1024 - 256) / 2
  EXPECT_EQ(DefaultMaxConnections(1 << 20), 523776u);  // (1048576 - 1024) / 2
  EXPECT_EQ(DefaultMaxConnections(2), 1u);
}

}  // namespace
}  // namespace losshead::testing
