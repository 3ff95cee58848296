// What the client re-sends and what it does not, against a stand-in server that fails every call
// with a chosen status and counts the calls it received.
#include <atomic>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "tests/load/load_util.h"

namespace losshead::testing {
namespace {

class FailingService final : public v1::LossHead::Service {
 public:
  explicit FailingService(grpc::StatusCode code) : code_(code) {}
  grpc::Status PullGradient(grpc::ServerContext*, const v1::PullGradientRequest*,
                            grpc::ServerWriter<v1::GradientChunk>*) override {
    ++pulls;
    return grpc::Status(code_, "stand-in failure");
  }
  grpc::Status GetStats(grpc::ServerContext*, const v1::GetStatsRequest*, v1::Stats*) override {
    ++stats;
    return grpc::Status(code_, "stand-in failure");
  }
  // Ends each Step call without reading it; CANCELLED as a server cancels it (RST_STREAM).
  grpc::Status Step(grpc::ServerContext* context,
                    grpc::ServerReaderWriter<v1::StepResponse, v1::StepRequest>*) override {
    ++steps;
    if (code_ == grpc::StatusCode::CANCELLED) context->TryCancel();
    return grpc::Status(code_, "stand-in failure");
  }
  std::atomic<int> pulls{0}, stats{0}, steps{0};

 private:
  const grpc::StatusCode code_;
};

struct StandIn {
  explicit StandIn(grpc::StatusCode code) : service(code) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
  }
  ~StandIn() { server->Shutdown(); }
  FailingService service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

TEST(RetryPolicyTest, UnavailableIsRetriedUpToMaxAttempts) {
  StandIn s(grpc::StatusCode::UNAVAILABLE);
  auto client = Connect(s.port, FastRetries(5));
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->GetStats().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.service.stats.load(), 5);
  EXPECT_EQ(client->PullGradient("h", v1::DTYPE_FP32, /*reset=*/false).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.service.pulls.load(), 5);
}

TEST(RetryPolicyTest, PullWithResetIsNeverResentOnceSent) {
  StandIn s(grpc::StatusCode::UNAVAILABLE);
  auto client = Connect(s.port, FastRetries(5));
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->PullGradient("h", v1::DTYPE_FP32, /*reset=*/true).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.service.pulls.load(), 1);
}

// gRPC's server cancels the calls that reach it while it shuts down, and the client sees
// CANCELLED although it cancelled nothing: the server going away, so UNAVAILABLE, and retried.
TEST(RetryPolicyTest, CallsTheServerCancelledAreUnavailableAndRetried) {
  StandIn s(grpc::StatusCode::CANCELLED);
  auto client = Connect(s.port, FastRetries(5));
  ASSERT_NE(client, nullptr);
  const absl::Status stats = client->GetStats().status();
  EXPECT_EQ(stats.code(), absl::StatusCode::kUnavailable) << stats;
  EXPECT_TRUE(absl::StrContains(stats.message(), "CANCELLED")) << stats;
  EXPECT_EQ(s.service.stats.load(), 5);
  const HostBatch batch = MakeBatch(4, 8, 16, v1::DTYPE_BF16, 1);
  const absl::Status step = client->Step(ToMicrobatch("h", "s", 1, batch)).status();
  EXPECT_EQ(step.code(), absl::StatusCode::kUnavailable) << step;
  EXPECT_EQ(s.service.steps.load(), 5);
  EXPECT_EQ(client->retries(), 8u);
}

TEST(RetryPolicyTest, PermanentErrorsAreNotRetried) {
  // RESOURCE_EXHAUSTED without a retry hint is a limit, not load.
  for (grpc::StatusCode code : {grpc::StatusCode::RESOURCE_EXHAUSTED,
                                grpc::StatusCode::INVALID_ARGUMENT, grpc::StatusCode::INTERNAL}) {
    StandIn s(code);
    auto client = Connect(s.port, FastRetries(5));
    ASSERT_NE(client, nullptr);
    EXPECT_EQ(static_cast<int>(client->GetStats().status().code()), static_cast<int>(code));
    EXPECT_EQ(s.service.stats.load(), 1);
    EXPECT_EQ(client->retries(), 0u);
  }
}

TEST(RetryPolicyTest, BackoffGrowsIsCappedAndHonoursTheHint) {
  client::RetryPolicy p;
  p.initial_backoff = absl::Milliseconds(10);
  p.max_backoff = absl::Milliseconds(50);
  p.multiplier = 2;
  p.jitter = 0;
  EXPECT_EQ(client::BackoffDelay(p, 1, absl::UnavailableError("")), absl::Milliseconds(10));
  EXPECT_EQ(client::BackoffDelay(p, 2, absl::UnavailableError("")), absl::Milliseconds(20));
  EXPECT_EQ(client::BackoffDelay(p, 9, absl::UnavailableError("")), absl::Milliseconds(50));
  absl::Status busy = absl::ResourceExhaustedError("busy");
  EXPECT_FALSE(client::IsRetryable(busy));
  busy.SetPayload(client::kRetryAfterPayload, absl::Cord("300"));
  EXPECT_TRUE(client::IsRetryable(busy));
  EXPECT_EQ(client::BackoffDelay(p, 1, busy), absl::Milliseconds(300));
}

}  // namespace
}  // namespace losshead::testing
