// Server-wide backpressure: refusals with a retry hint while another stream holds the bounds,
// bounds given back at once on cancel and on deadline, and retries that succeed once room frees.
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/load/load_util.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kV = 29, kD = 16, kN = 64;
// What a kN-token fp32 micro-batch with int32 targets announces: N x (D x 4 + 4).
constexpr size_t kBytes = kN * (kD * 4 + 4);

class BackpressureTest : public ::testing::TestWithParam<bool> {
 protected:
  // Param: true bounds the bytes (room for one micro-batch), false the micro-batch count (one).
  void SetUp() override {
    const bool bytes = GetParam();
    auto s = StartServer([&](server::ServerOptions& o) {
      o.max_microbatch_bytes = kBytes + 64;
      o.max_inflight_bytes = bytes ? kBytes + 64 : size_t{1} << 30;
      o.max_inflight_microbatches = bytes ? 1024 : 1;
      o.retry_after = absl::Milliseconds(7);
    });
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    client_ = Connect(server_->port(), FastRetries(1));
    ASSERT_NE(client_, nullptr);
    auto head = CreateKnownHead(*client_, "bp", kV, kD, v1::DTYPE_FP32, 1);
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;
    stub_ = v1::LossHead::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                                      grpc::InsecureChannelCredentials()));
    holder_batch_ = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 11);
    batch_ = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 12);
  }

  // Opens a raw stream that sends the first of 4 pieces of a micro-batch and then waits: it holds
  // one admission and the micro-batch's announced bytes.
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> Hold(
      grpc::ClientContext* context) {
    auto stream = stub_->Step(context);
    const auto messages = StepMessages(ToMicrobatch(head_.name, "holder", 1, holder_batch_), 4);
    EXPECT_TRUE(stream->Write(messages[0]));
    const v1::Stats s =
        WaitForStats(*client_, [](const v1::Stats& s) { return s.admitted_microbatches() == 1; });
    EXPECT_EQ(s.admitted_microbatches(), 1u);
    EXPECT_EQ(s.reserved_bytes(), kBytes);
    return stream;
  }

  void ExpectNothingHeld() {
    const v1::Stats s = WaitForStats(*client_, [](const v1::Stats& s) {
      return s.admitted_microbatches() == 0 && s.reserved_bytes() == 0 &&
             s.inflight_microbatches() == 0;
    });
    EXPECT_EQ(s.admitted_microbatches(), 0u);
    EXPECT_EQ(s.reserved_bytes(), 0u);
    EXPECT_EQ(s.inflight_microbatches(), 0u);
  }

  std::unique_ptr<server::Server> server_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<v1::LossHead::Stub> stub_;
  KnownHead head_;
  HostBatch holder_batch_, batch_;
};

TEST_P(BackpressureTest, RefusedWithRetryHintThenFreedAtOnceByCancel) {
  grpc::ClientContext holder;
  auto stream = Hold(&holder);

  const client::Microbatch mb = ToMicrobatch(head_.name, "other", 1, batch_);
  absl::StatusOr<client::StepResult> refused = client_->Step(mb);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "retry after 7 ms"))
      << refused.status();
  ASSERT_TRUE(client::RetryAfter(refused.status()).has_value());
  EXPECT_EQ(*client::RetryAfter(refused.status()), absl::Milliseconds(7));
  auto info = client_->GetHead(head_.name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), 0u);  // the refusal changed nothing

  holder.TryCancel();
  v1::StepResponse response;
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ExpectNothingHeld();

  // The same key again: now admitted, computed once.
  auto ok = client_->Step(mb);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(ok->replayed);
  info = client_->GetHead(head_.name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), 1u);
  EXPECT_EQ(static_cast<int64_t>(info->tokens_total()), ok->token_count);
  ExpectNothingHeld();
}

TEST_P(BackpressureTest, OversizeIsRefusedForGoodWithoutRetryHintEvenWhenBusy) {
  grpc::ClientContext holder;
  auto stream = Hold(&holder);
  // Twice the tokens: over --max_microbatch_bytes whatever the server is doing.
  const HostBatch big = MakeBatch(2 * kN, kD, kV, v1::DTYPE_FP32, 13);
  auto retrying = Connect(server_->port(), FastRetries(100));
  ASSERT_NE(retrying, nullptr);
  for (uint64_t sequence : {1, 2}) {
    client::Microbatch mb = ToMicrobatch(head_.name, "big", sequence, big);
    absl::StatusOr<client::StepResult> refused = retrying->Step(mb);
    ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "--max_microbatch_bytes"))
        << refused.status();
    EXPECT_FALSE(client::RetryAfter(refused.status()).has_value()) << refused.status();
  }
  EXPECT_EQ(retrying->retries(), 0u);  // nothing to wait for: no retry was made
  holder.TryCancel();
  v1::StepResponse response;
  EXPECT_FALSE(stream->Read(&response));
  stream->Finish();
  ExpectNothingHeld();
}

TEST_P(BackpressureTest, ClientRetriesUntilRoomFrees) {
  grpc::ClientContext holder;
  auto stream = Hold(&holder);
  auto retrying = Connect(server_->port(), FastRetries(100000));
  ASSERT_NE(retrying, nullptr);
  absl::StatusOr<client::StepResult> got;
  std::thread t([&] { got = retrying->Step(ToMicrobatch(head_.name, "patient", 1, batch_)); });
  // Let it be refused a few times, then free the room.
  while (retrying->retries() < 3) absl::SleepFor(absl::Milliseconds(1));
  holder.TryCancel();
  t.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE(got->replayed);
  EXPECT_GE(retrying->retries(), 3u);
  auto info = client_->GetHead(head_.name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), 1u);
  v1::StepResponse response;
  while (stream->Read(&response)) {
  }
  stream->Finish();
  ExpectNothingHeld();
}

TEST_P(BackpressureTest, DeadlineEndsAStalledStreamAndFreesItsBounds) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  auto stream = stub_->Step(&context);
  const auto messages = StepMessages(ToMicrobatch(head_.name, "late", 1, holder_batch_), 4);
  ASSERT_TRUE(stream->Write(messages[0]));
  v1::StepResponse response;
  EXPECT_FALSE(stream->Read(&response));  // returns once the deadline has passed
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ExpectNothingHeld();
  auto info = client_->GetHead(head_.name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Bounds, BackpressureTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Bytes" : "Microbatches"; });

}  // namespace
}  // namespace losshead::testing
