// The C ABI suites' fixture: one losshead-server child process (CPU backend) for a suite, a C
// ABI client per test, and fresh fp32 heads made with the `losshead` tool (a suite links no
// protobuf code of its own: CMakeLists.txt says why). LOSSHEAD_SERVER_BINARY and
// LOSSHEAD_CLI_BINARY come from the build.
#ifndef LOSSHEAD_TESTS_CAPI_CAPI_FIXTURE_H_
#define LOSSHEAD_TESTS_CAPI_CAPI_FIXTURE_H_

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/capi.h"
#include "tests/common/server_process.h"

class CapiServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // A log of this process's own: the server's port is read from it, and ctest runs the
    // suite's tests as processes side by side.
    const std::string log = absl::StrCat(
        ::testing::TempDir(), "/", ::testing::UnitTest::GetInstance()->current_test_suite()->name(),
        "-", getpid(), ".log");
    auto server =
        losshead::testing::ServerProcess::Start(LOSSHEAD_SERVER_BINARY, {"--backend=cpu"}, log);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    lh_status status{};
    ASSERT_EQ(lh_client_connect(server_->target().c_str(), nullptr, &client_, &status), 0)
        << status.message;
  }
  void TearDown() override { lh_client_free(client_); }

  // A fresh fp32 V x D head named after the test, created by the `losshead` tool with `flags`
  // (e.g. " --bias") appended to its command line.
  std::string CreateHead(int64_t vocab_size, int64_t hidden_size, const std::string& flags = "") {
    const std::string name = absl::StrCat(
        ::testing::UnitTest::GetInstance()->current_test_info()->test_suite_name(), "-",
        ::testing::UnitTest::GetInstance()->current_test_info()->name(), "-", heads_++);
    const std::string command =
        absl::StrCat(LOSSHEAD_CLI_BINARY, " create --server=", server_->target(), " --head=", name,
                     " --vocab_size=", vocab_size, " --hidden_size=", hidden_size,
                     " --weight_dtype=fp32", flags, " > /dev/null");
    EXPECT_EQ(std::system(command.c_str()), 0) << command;
    return name;
  }

  static inline losshead::testing::ServerProcess* server_ = nullptr;
  lh_client* client_ = nullptr;
  int heads_ = 0;
};

#endif  // LOSSHEAD_TESTS_CAPI_CAPI_FIXTURE_H_
