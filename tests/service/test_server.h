// A real losshead server (CPU backend) on loopback ports picked by the OS, and clients of it.
#ifndef LOSSHEAD_TESTS_SERVICE_TEST_SERVER_H_
#define LOSSHEAD_TESTS_SERVICE_TEST_SERVER_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "losshead/client/client.h"
#include "server/server.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {

class TestServer {
 public:
  static absl::StatusOr<std::unique_ptr<TestServer>> Start(size_t max_message_bytes = size_t{4}
                                                                                      << 20,
                                                           bool metrics = false);
  ~TestServer();

  std::string target() const;
  int metrics_port() const { return server_->metrics_port(); }
  server::Server& server() { return *server_; }
  // A client with the server's message limit unless told otherwise.
  std::unique_ptr<client::Client> NewClient(size_t max_message_bytes = 0) const;

 private:
  std::unique_ptr<server::Server> server_;
  size_t max_message_bytes_ = 0;
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
                                          double std = 0.5);

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_SERVICE_TEST_SERVER_H_
