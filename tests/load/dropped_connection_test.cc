// Connections dropped mid-stream: inside a micro-batch's request pieces, inside its response, and
// at the TCP level through a proxy that slams both sockets. The server stays healthy, a partial
// micro-batch changes nothing, and the retry of the same key on a new stream counts exactly once.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/load/load_util.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kV = 41, kD = 32, kN = 48;

class DroppedConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Small messages: requests and responses travel in many pieces.
    auto s = StartServer([](server::ServerOptions& o) { o.max_message_bytes = 4096; });
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    client_ = Connect(server_->port(), FastRetries(50), 4096);
    ASSERT_NE(client_, nullptr);
    auto head = CreateKnownHead(*client_, "drop", kV, kD, v1::DTYPE_FP32, 3);
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;
    stub_ = v1::LossHead::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                                      grpc::InsecureChannelCredentials()));
    batch_ = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 21, 5);
    ref_ = Reference(head_.weight, batch_.hidden, batch_.targets, kN, kD, kV, {});
  }

  // After the retry: exactly one micro-batch counted, dW equal to the reference, nothing held.
  void ExpectCountedOnce() {
    auto info = client_->GetHead(head_.name);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->microbatches_total(), 1u);
    EXPECT_EQ(static_cast<int64_t>(info->tokens_total()), ref_.token_count);
    auto g = client_->PullGradient(head_.name, v1::DTYPE_FP32, false);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->summary.microbatch_count(), 1u);
    EXPECT_TRUE(AllClose(Decode(g->data, v1::DTYPE_FP32), ref_.grad_weight, 1e-5));
    const v1::Stats s = WaitForStats(*client_, [](const v1::Stats& s) {
      return s.admitted_microbatches() == 0 && s.reserved_bytes() == 0 &&
             s.inflight_microbatches() == 0;
    });
    EXPECT_EQ(s.admitted_microbatches(), 0u);
    EXPECT_EQ(s.reserved_bytes(), 0u);
  }

  std::unique_ptr<server::Server> server_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<v1::LossHead::Stub> stub_;
  KnownHead head_;
  HostBatch batch_;
  RefResult ref_;
};

TEST_F(DroppedConnectionTest, CancelInsideRequestPiecesChangesNothingAndRetryCountsOnce) {
  const client::Microbatch mb = ToMicrobatch(head_.name, "c", 7, batch_);
  {
    grpc::ClientContext context;
    auto stream = stub_->Step(&context);
    const auto messages = StepMessages(mb, 5);
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(stream->Write(messages[i]));
    WaitForStats(*client_, [](const v1::Stats& s) { return s.admitted_microbatches() == 1; });
    context.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  auto info = client_->GetHead(head_.name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), 0u);
  auto got = client_->Step(mb);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE(got->replayed);
  ExpectCountedOnce();
}

TEST_F(DroppedConnectionTest, CancelInsideResponseThenRetryIsReplayed) {
  const client::Microbatch mb = ToMicrobatch(head_.name, "c", 8, batch_);
  {
    grpc::ClientContext context;
    auto stream = stub_->Step(&context);
    for (const auto& m : StepMessages(mb, 3)) ASSERT_TRUE(stream->Write(m));
    v1::StepResponse first;
    ASSERT_TRUE(stream->Read(&first));  // the result: computed and counted
    ASSERT_TRUE(first.has_result());
    ASSERT_FALSE(first.last());  // dH follows in further pieces, never read
    context.TryCancel();
    while (stream->Read(&first)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  auto got = client_->Step(mb);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->replayed);
  EXPECT_EQ(got->token_count, ref_.token_count);
  EXPECT_EQ(got->grad_hidden.size(), static_cast<size_t>(kN * kD * 4));
  ExpectCountedOnce();
}

// Forwards one loopback TCP connection at a time to the server; Slam() shuts both sockets of
// every live connection down mid-flight (a dropped connection as the kernel reports it).
class SlamProxy {
 public:
  explicit SlamProxy(int backend_port) : backend_port_(backend_port) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    socklen_t len = sizeof(addr);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    listen(listen_fd_, 16);
    acceptor_ = std::thread([this] { Accept(); });
  }
  ~SlamProxy() {
    stop_ = true;
    shutdown(listen_fd_, SHUT_RDWR);
    close(listen_fd_);
    Slam();
    acceptor_.join();
    for (auto& t : pumps_) t.join();
  }
  int port() const { return port_; }
  uint64_t bytes() const { return bytes_.load(); }
  void Slam() {
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
  }

 private:
  void Accept() {
    while (!stop_) {
      const int in = accept(listen_fd_, nullptr, nullptr);
      if (in < 0) return;
      const int out = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(backend_port_);
      if (connect(out, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        close(in);
        close(out);
        continue;
      }
      std::lock_guard<std::mutex> lock(mu_);
      fds_.push_back(in);
      fds_.push_back(out);
      pumps_.emplace_back([this, in, out] { Pump(in, out); });
    }
  }
  void Pump(int a, int b) {
    char buf[16384];
    pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    while (true) {
      if (poll(fds, 2, 200) < 0) break;
      if (stop_ && fds[0].revents == 0 && fds[1].revents == 0) break;
      bool done = false;
      for (int i = 0; i < 2 && !done; ++i) {
        if (fds[i].revents == 0) continue;
        const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
        // MSG_NOSIGNAL: after Slam() the other socket is shut down, and write() there would raise
        // SIGPIPE and kill the whole test binary instead of ending this pump.
        if (n <= 0 || send(fds[1 - i].fd, buf, n, MSG_NOSIGNAL) != n) done = true;
        if (n > 0) bytes_ += n;
      }
      if (done) break;
    }
    shutdown(a, SHUT_RDWR);
    shutdown(b, SHUT_RDWR);
    close(a);
    close(b);
  }

  const int backend_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> bytes_{0};
  std::mutex mu_;
  std::vector<int> fds_;
  std::vector<std::thread> pumps_;
  std::thread acceptor_;
};

TEST_F(DroppedConnectionTest, TcpDropMidStreamThenStepManyResendsEachKeyOnce) {
  SlamProxy proxy(server_->port());
  auto via_proxy = Connect(proxy.port(), FastRetries(200), 4096);
  ASSERT_NE(via_proxy, nullptr);
  constexpr int kMicrobatches = 12;
  std::vector<HostBatch> batches;
  std::vector<client::Microbatch> mbs;
  std::vector<double> want(kV * kD, 0.0);
  int64_t want_tokens = 0;
  for (int i = 0; i < kMicrobatches; ++i)
    batches.push_back(MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 100 + i, 3));
  for (int i = 0; i < kMicrobatches; ++i) {
    mbs.push_back(ToMicrobatch(head_.name, "tcp", i + 1, batches[i]));
    const RefResult r =
        Reference(head_.weight, batches[i].hidden, batches[i].targets, kN, kD, kV, {});
    want_tokens += r.token_count;
    for (size_t k = 0; k < want.size(); ++k) want[k] += r.grad_weight[k];
  }
  // Slam the connection while the first micro-batches are on the wire.
  std::thread slammer([&] {
    while (proxy.bytes() < 20000) absl::SleepFor(absl::Microseconds(200));
    proxy.Slam();
  });
  auto answers = via_proxy->StepMany(mbs, 4);
  slammer.join();
  int64_t tokens = 0;
  for (const auto& a : answers) {
    ASSERT_TRUE(a.ok()) << a.status();
    tokens += a->token_count;
  }
  EXPECT_EQ(tokens, want_tokens);
  EXPECT_GE(via_proxy->retries(), 1u);
  auto info = client_->GetHead(head_.name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), static_cast<uint64_t>(kMicrobatches));
  EXPECT_EQ(static_cast<int64_t>(info->tokens_total()), want_tokens);
  auto g = client_->PullGradient(head_.name, v1::DTYPE_FP32, false);
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(AllClose(Decode(g->data, v1::DTYPE_FP32), want, 1e-5));
}

}  // namespace
}  // namespace losshead::testing
