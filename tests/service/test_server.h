// A real losshead server (CPU backend) on loopback ports picked by the OS, and clients of it.
#ifndef LOSSHEAD_TESTS_SERVICE_TEST_SERVER_H_
#define LOSSHEAD_TESTS_SERVICE_TEST_SERVER_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "server/server.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {

inline constexpr size_t kTestServerMessageBytes = size_t{4} << 20;

class TestServer {
 public:
  static absl::StatusOr<std::unique_ptr<TestServer>> Start(
      size_t max_message_bytes = kTestServerMessageBytes, bool metrics = false);
  // The options Start uses, for a test that changes some before StartWith.
  static server::ServerOptions Options(size_t max_message_bytes = kTestServerMessageBytes,
                                       bool metrics = false);
  static absl::StatusOr<std::unique_ptr<TestServer>> StartWith(
      const server::ServerOptions& options);
  ~TestServer();

  std::string target() const;
  int metrics_port() const { return server_->metrics_port(); }
  server::Server& server() { return *server_; }
  // A client with the server's message limit unless told otherwise. It takes the same-node path
  // (docs/same-node.md) unless `same_node` is false: tests of how tensors are framed in the
  // stream's messages ask for the network path.
  std::unique_ptr<client::Client> NewClient(size_t max_message_bytes = 0,
                                            bool same_node = true) const;

 private:
  std::unique_ptr<server::Server> server_;
  size_t max_message_bytes_ = 0;
};

// A suite whose tests share one TestServer with message limit kMaxMessageBytes (and a metrics
// endpoint with kMetrics), started before the suite's first test and stopped after its last; each
// test gets a fresh client_ with that limit. Suites run one after another, so suites with the same
// parameters never hold server_ at once.
template <size_t kMaxMessageBytes = kTestServerMessageBytes, bool kMetrics = false>
class SharedServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto s = TestServer::Start(kMaxMessageBytes, kMetrics);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = s->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    client_ = server_->NewClient();
    ASSERT_NE(client_, nullptr);
  }

  static inline TestServer* server_ = nullptr;
  std::unique_ptr<client::Client> client_;
};

// A head whose W the test knows exactly: created, then W uploaded in the head's dtype.
struct KnownHead {
  std::string name;
  int64_t v = 0;
  int64_t d = 0;
  v1::DType dtype = v1::DTYPE_FP32;
  std::vector<float> weight;  // V x D, exact in dtype
  uint64_t version = 0;
};
absl::StatusOr<KnownHead> CreateKnownHead(client::Client& client, const std::string& name,
                                          int64_t v, int64_t d, v1::DType dtype, uint64_t seed,
                                          double std = 0.5,
                                          const v1::Placement& placement = v1::Placement());

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_SERVICE_TEST_SERVER_H_
