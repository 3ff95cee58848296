// Answers the client does not read: they count against --max_inflight_bytes while they wait to be
// written, and a stream whose answer waits --step_unread_timeout is ended ABORTED with its
// admissions released; what it computed stays counted once and its keys replay the answers. A
// client that reads slowly but steadily is not ended.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "server/server.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/raw_step_stream.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

// Micro-batches whose dH (8 MiB) is far more than a connection takes in without being read.
constexpr int64_t kD = 512, kV = 19, kN = 4096;
constexpr size_t kGradBytes = kN * kD * 4;
constexpr size_t kRequestBytes = kN * (kD * 4 + 4);
constexpr size_t kPieceBytes = size_t{2} << 20;

// Sends `batch` as one micro-batch in pieces below the message limit.
void Send(RawStream& s, const std::string& head, const std::string& client, uint64_t sequence,
          const HostBatch& batch) {
  const auto* hidden = reinterpret_cast<const char*>(batch.hidden_bytes.data());
  v1::StepRequest message = Header(head, client, sequence, batch.n);
  for (size_t at = 0; at < batch.hidden_bytes.size(); at += kPieceBytes) {
    message.set_hidden(hidden + at, std::min(kPieceBytes, batch.hidden_bytes.size() - at));
    if (at + kPieceBytes >= batch.hidden_bytes.size()) {
      message.set_targets(reinterpret_cast<const char*>(batch.target_bytes.data()),
                          batch.target_bytes.size());
      message.set_last(true);
    }
    ASSERT_TRUE(s.Write(message));
    message.Clear();
  }
}

// The answer's loss and dH against the float64 reference.
void ExpectAnswer(const client::StepResult& got, const KnownHead& head, const HostBatch& batch) {
  const RefResult want =
      Reference(head.weight, batch.hidden, batch.targets, batch.n, head.d, head.v, RefOptions{});
  EXPECT_NEAR(got.loss, want.loss, ToleranceFor(v1::DTYPE_FP32).loss_rel * std::abs(want.loss));
  EXPECT_EQ(got.token_count, want.token_count);
  EXPECT_TRUE(AllClose(Decode(got.grad_hidden, v1::DTYPE_FP32), want.grad_hidden,
                       ToleranceFor(v1::DTYPE_FP32).grad));
}

// The parts of a raw answer that ExpectAnswer checks.
client::StepResult ToResult(const ReadAnswer& answer) {
  client::StepResult got;
  got.loss = answer.first.result().loss();
  got.token_count = answer.first.result().token_count();
  got.grad_hidden.resize(answer.grad_hidden.size());
  std::memcpy(got.grad_hidden.data(), answer.grad_hidden.data(), got.grad_hidden.size());
  return got;
}

class UnreadAnswersTest : public ::testing::Test {
 protected:
  void Start(const server::ServerOptions& options) {
    auto s = TestServer::StartWith(options);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    client_ = server_->NewClient();
    ASSERT_NE(client_, nullptr);
    auto head = CreateKnownHead(*client_, "h", kV, kD, v1::DTYPE_FP32, 1);
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;
  }

  // Polls the server's stats until `pred` holds; false if it never does within `limit`.
  bool AwaitStats(const std::function<bool(const v1::Stats&)>& pred,
                  absl::Duration limit = absl::Seconds(10)) {
    for (const absl::Time give_up = absl::Now() + limit; absl::Now() < give_up;) {
      auto stats = client_->GetStats();
      if (stats.ok() && pred(*stats)) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  }
  bool AwaitMicrobatches(uint64_t count) {
    for (const absl::Time give_up = absl::Now() + absl::Seconds(20); absl::Now() < give_up;) {
      auto info = client_->GetHead(head_.name);
      if (info.ok() && info->microbatches_total() >= count) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  }

  std::unique_ptr<TestServer> server_;
  std::unique_ptr<client::Client> client_;
  KnownHead head_;
};

// A computed micro-batch whose answer is not read keeps its answer's bytes booked in the byte
// bound until it is written: another micro-batch that would pass the bound is refused with a
// retry hint meanwhile, and admitted once the answer has been read.
TEST_F(UnreadAnswersTest, AnswersWaitingToBeReadCountAgainstTheByteBound) {
  server::ServerOptions options = TestServer::Options();
  options.max_microbatch_bytes = kRequestBytes;
  options.max_inflight_bytes = kRequestBytes + kRequestBytes / 2;
  Start(options);
  const HostBatch held = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 2);
  RawStream unread(server_->target());
  Send(unread, head_.name, "unread", 1, held);
  ASSERT_TRUE(AwaitMicrobatches(1));
  // Computed: its request bytes are freed and its answer's take their place until written.
  EXPECT_TRUE(AwaitStats([](const v1::Stats& s) {
    return s.admitted_microbatches() == 1 && s.reserved_bytes() == kGradBytes;
  })) << client_->GetStats()->DebugString();

  client::ClientOptions no_retry;
  no_retry.max_message_bytes = TestServer::Options().max_message_bytes;
  no_retry.retry.max_attempts = 1;
  auto once = client::Client::Connect(server_->target(), no_retry);
  ASSERT_TRUE(once.ok()) << once.status();
  const HostBatch other = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 3);
  const absl::StatusOr<client::StepResult> refused =
      (*once)->Step(ToMicrobatch(head_.name, "other", 1, other));
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_GT(client::RetryAfter(refused.status()).value_or(absl::ZeroDuration()),
            absl::ZeroDuration());

  // Read at last: the whole answer arrives, and the bound is free again.
  unread.WritesDone();
  unread.ReadInBackground();
  ASSERT_TRUE(unread.Ended().ok()) << unread.Ended().error_message();
  const std::vector<ReadAnswer> answers = Answers(unread.responses());
  ASSERT_EQ(answers.size(), 1u);
  ASSERT_TRUE(answers[0].first.has_result()) << answers[0].first.error().message();
  ASSERT_TRUE(answers[0].complete);
  ExpectAnswer(ToResult(answers[0]), head_, held);
  EXPECT_TRUE(AwaitStats([](const v1::Stats& s) {
    return s.admitted_microbatches() == 0 && s.reserved_bytes() == 0;
  })) << client_->GetStats()->DebugString();
  auto admitted = (*once)->Step(ToMicrobatch(head_.name, "other", 1, other));
  ASSERT_TRUE(admitted.ok()) << admitted.status();
  ExpectAnswer(*admitted, head_, other);
}

// Three streams send a micro-batch each and never read: they hold every admission of the server
// (--max_inflight_microbatches=3) until --step_unread_timeout ends them ABORTED, naming the flag
// and their keys. An honest micro-batch refused meanwhile is then admitted; what the three
// computed is counted once, and their keys replay their answers.
TEST_F(UnreadAnswersTest, StreamsThatDoNotReadAreEndedAndReleaseTheirAdmissions) {
  constexpr absl::Duration kUnread = absl::Milliseconds(300);
  server::ServerOptions options = TestServer::Options(kTestServerMessageBytes, /*metrics=*/true);
  options.max_inflight_microbatches = 3;
  options.step_unread_timeout = kUnread;
  Start(options);
  std::vector<HostBatch> batches;
  std::vector<std::unique_ptr<RawStream>> streams;
  for (int i = 0; i < 3; ++i) {
    batches.push_back(MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 10 + i));
    streams.push_back(std::make_unique<RawStream>(server_->target()));
    Send(*streams.back(), head_.name, absl::StrCat("unread-", i), 1, batches.back());
  }
  ASSERT_TRUE(AwaitMicrobatches(3));
  const absl::Time computed = absl::Now();

  const HostBatch honest = MakeBatch(2, kD, kV, v1::DTYPE_FP32, 20);
  absl::StatusOr<client::StepResult> got;
  int refused = 0;
  do {
    got = client_->Step(ToMicrobatch(head_.name, "honest", 1, honest));
    if (got.ok() || got.status().code() != absl::StatusCode::kResourceExhausted) break;
    ++refused;
  } while (absl::Now() - computed < absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status() << " (" << refused
                        << " refusals while unread answers held every admission)";
  ExpectAnswer(*got, head_, honest);
  // All three let go (the last one's answer may have been written a moment after the others'),
  // before any of them reads.
  ASSERT_TRUE(AwaitStats([](const v1::Stats& s) {
    return s.admitted_microbatches() == 0 && s.reserved_bytes() == 0 &&
           s.inflight_microbatches() == 0;
  })) << client_->GetStats()->DebugString();

  for (int i = 0; i < 3; ++i) {
    streams[i]->ReadInBackground();
    const grpc::Status status = streams[i]->Ended();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
    EXPECT_NE(status.error_message().find("--step_unread_timeout=300ms"), std::string::npos)
        << status.error_message();
    EXPECT_NE(status.error_message().find(absl::StrCat("client 'unread-", i, "', sequence 1")),
              std::string::npos)
        << status.error_message();
    // Whatever arrived before the end is a prefix of the answer: never a complete one.
    for (const ReadAnswer& a : Answers(streams[i]->responses())) EXPECT_FALSE(a.complete);
  }

  // Counted once: each key replays its answer without computing it again.
  for (int i = 0; i < 3; ++i) {
    auto again = client_->Step(ToMicrobatch(head_.name, absl::StrCat("unread-", i), 1, batches[i]));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->replayed);
    ExpectAnswer(*again, head_, batches[i]);
  }
  auto info = client_->GetHead(head_.name);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->microbatches_total(), 4u);
  auto pulled = client_->PullGradient(head_.name, v1::DTYPE_FP32, false);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  std::vector<double> want(static_cast<size_t>(kV * kD), 0.0);
  batches.push_back(honest);
  for (const HostBatch& batch : batches) {
    const RefResult r =
        Reference(head_.weight, batch.hidden, batch.targets, batch.n, kD, kV, RefOptions{});
    for (size_t k = 0; k < want.size(); ++k) want[k] += r.grad_weight[k];
  }
  EXPECT_TRUE(
      AllClose(Decode(pulled->data, v1::DTYPE_FP32), want, ToleranceFor(v1::DTYPE_FP32).grad));

  const absl::StatusOr<Exposition> e =
      ScrapeWhen(server_->metrics_port(), "losshead_rpcs_total",
                 {{"method", "Step"}, {"code", "aborted"}}, 3);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->Sum("losshead_unread_answer_aborts_total"), 3);
  EXPECT_EQ(e->Sum("losshead_rpcs_total", {{"method", "Step"}, {"code", "aborted"}}), 3);
}

// A client that reads its answers slowly but steadily is not ended: with a 2 s timeout, three
// micro-batches whose answers take 12 messages are read one message every 250 ms (3 s in all),
// and arrive whole.
TEST_F(UnreadAnswersTest, AClientThatReadsSlowlyIsNotEnded) {
  server::ServerOptions options = TestServer::Options(kTestServerMessageBytes, /*metrics=*/true);
  options.step_unread_timeout = absl::Seconds(2);
  Start(options);
  std::vector<HostBatch> batches;
  RawStream s(server_->target());
  s.ReadInBackground(absl::Milliseconds(250));
  const absl::Time start = absl::Now();
  for (int i = 0; i < 3; ++i) {
    batches.push_back(MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 30 + i));
    Send(s, head_.name, "slow-reader", i + 1, batches.back());
  }
  s.WritesDone();
  const grpc::Status status = s.Ended();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_GT(absl::Now() - start, absl::Seconds(2));
  const std::vector<ReadAnswer> answers = Answers(s.responses());
  ASSERT_EQ(answers.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(answers[i].complete);
    ASSERT_TRUE(answers[i].first.has_result()) << answers[i].first.error().message();
    ExpectAnswer(ToResult(answers[i]), head_, batches[i]);
  }
  auto body = HttpGet(server_->metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  auto e = ParseExposition(*body);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->Sum("losshead_unread_answer_aborts_total"), 0);
}

}  // namespace
}  // namespace losshead::testing
