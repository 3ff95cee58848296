// Streams that stop in the middle of a micro-batch let go: after --step_stall_timeout without
// progress (a message of its bytes; empty messages and small pieces are none) their reservation is
// released, the stream ends ABORTED naming the micro-batch, the flag and the time, the event is
// counted, and well-behaved clients refused meanwhile are admitted afterwards with nothing lost or
// counted twice. A micro-batch that arrives slowly but steadily is kept.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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

constexpr int64_t kD = 8, kV = 19;
// The largest micro-batch: 1024 fp32 tokens with int32 targets; the server admits two at a time.
constexpr int64_t kFullTokens = 1024;
constexpr size_t kFullBytes = kFullTokens * (kD * 4 + 4);
constexpr absl::Duration kStall = absl::Milliseconds(200);

class StalledStreamTest : public ::testing::Test {
 protected:
  // The server's options; a suite derived from this one may change them.
  virtual void Adjust(server::ServerOptions& options) {}

  void SetUp() override {
    server::ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.metrics_address = "127.0.0.1:0";
    options.backend = kernels::BackendKind::kCpu;
    options.worker_threads = 2;
    options.workspace_bytes = size_t{64} << 20;
    options.max_microbatch_bytes = kFullBytes;
    options.max_inflight_bytes = 2 * kFullBytes;
    options.step_stall_timeout = kStall;
    Adjust(options);
    auto server = server::Server::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    target_ = absl::StrCat("127.0.0.1:", server_->port());
    client::ClientOptions client_options;
    client_options.deadline = absl::Seconds(30);
    auto c = client::Client::Connect(target_, client_options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    auto head = CreateKnownHead(*client_, "h", kV, kD, v1::DTYPE_FP32, 1);
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;
  }
  void TearDown() override {
    client_.reset();
    if (server_ != nullptr) {
      server_->Shutdown(absl::Seconds(5));
      server_->Wait();
    }
  }

  std::unique_ptr<server::Server> server_;
  std::string target_;
  std::unique_ptr<client::Client> client_;
  KnownHead head_;
};

TEST_F(StalledStreamTest, StalledReservationsAreReleasedAndWellBehavedClientsLoseNothing) {
  // Three streams each announce the largest micro-batch and then send nothing: two fill the
  // server's byte bound, the third is refused at once with a retry hint.
  std::vector<std::unique_ptr<RawStream>> stalled;
  const absl::Time before_headers = absl::Now();  // no stall can end before this + kStall
  for (int i = 0; i < 3; ++i) {
    stalled.push_back(std::make_unique<RawStream>(target_));
    ASSERT_TRUE(
        stalled.back()->Write(Header(head_.name, absl::StrCat("stalled-", i), 1, kFullTokens)));
  }
  for (auto& s : stalled) s->ReadInBackground();
  RawStream* refused = nullptr;
  std::vector<RawStream*> held;
  for (auto& s : stalled) {
    if (s->AwaitResponseOrEnd(absl::Milliseconds(100))) {
      ASSERT_EQ(refused, nullptr) << "two stalled micro-batches should hold the whole byte bound";
      refused = s.get();
      const v1::StepResponse r = s->responses().front();
      EXPECT_EQ(r.error().code(), static_cast<int>(absl::StatusCode::kResourceExhausted))
          << r.error().message();
      EXPECT_GT(r.error().retry_after_ms(), 0u);
      s->WritesDone();  // it gives up; ending inside the refused micro-batch is fine
    } else {
      held.push_back(s.get());
    }
  }
  ASSERT_NE(refused, nullptr);
  ASSERT_EQ(held.size(), 2u);
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  if (absl::Now() - before_headers < kStall) {  // not yet released (a slow machine may be late)
    EXPECT_EQ(stats->reserved_bytes(), 2 * kFullBytes);
    EXPECT_EQ(stats->admitted_microbatches(), 2u);
  }

  // Well-behaved clients meanwhile: two of the largest micro-batches, retried under backpressure
  // by the client until the stalled reservations are released.
  std::vector<HostBatch> batches;
  for (uint64_t seed = 2; seed < 6; ++seed) {
    batches.push_back(MakeBatch(kFullTokens, kD, kV, v1::DTYPE_FP32, seed, 7));
  }
  absl::StatusOr<client::StepResult> got_a, got_b;
  {
    std::thread other(
        [&] { got_b = client_->Step(ToMicrobatch(head_.name, "good", 2, batches[1])); });
    got_a = client_->Step(ToMicrobatch(head_.name, "good", 1, batches[0]));
    other.join();
  }
  ASSERT_TRUE(got_a.ok()) << got_a.status();
  ASSERT_TRUE(got_b.ok()) << got_b.status();
  EXPECT_FALSE(got_a->replayed || got_b->replayed);

  for (RawStream* s : held) {
    const grpc::Status status = s->Ended();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
    EXPECT_NE(status.error_message().find("--step_stall_timeout=200ms"), std::string::npos)
        << status.error_message();
    EXPECT_NE(status.error_message().find("sequence 1"), std::string::npos);
    EXPECT_NE(status.error_message().find("stalled-"), std::string::npos);
    EXPECT_TRUE(s->responses().empty());
    EXPECT_GE(s->ended_at() - before_headers, kStall);
  }
  EXPECT_TRUE(refused->Ended().ok()) << refused->Ended().error_message();
  // Nothing stays held (the last answers' writes may complete a moment after the client has them).
  for (const absl::Time give_up = absl::Now() + absl::Seconds(10);;) {
    stats = client_->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    if (stats->reserved_bytes() == 0 && stats->admitted_microbatches() == 0) break;
    ASSERT_LT(absl::Now(), give_up) << stats->DebugString();
    absl::SleepFor(absl::Milliseconds(5));
  }

  // Both stalled reservations are back: two of the largest micro-batches are admitted together
  // (both headers before any data, so each holds its reservation while the other is admitted).
  RawStream c(target_), d(target_);
  ASSERT_TRUE(c.Write(Header(head_.name, "c", 1, kFullTokens)));
  ASSERT_TRUE(d.Write(Header(head_.name, "d", 1, kFullTokens)));
  for (auto [stream, batch] : {std::pair{&c, &batches[2]}, std::pair{&d, &batches[3]}}) {
    v1::StepRequest data;
    data.set_hidden(reinterpret_cast<const char*>(batch->hidden_bytes.data()),
                    batch->hidden_bytes.size());
    data.set_targets(reinterpret_cast<const char*>(batch->target_bytes.data()),
                     batch->target_bytes.size());
    data.set_last(true);
    ASSERT_TRUE(stream->Write(data));
    stream->WritesDone();
    stream->ReadInBackground();
  }
  int64_t tokens = got_a->token_count + got_b->token_count;
  for (RawStream* stream : {&c, &d}) {
    EXPECT_TRUE(stream->Ended().ok());
    const std::vector<v1::StepResponse> responses = stream->responses();
    ASSERT_FALSE(responses.empty());
    ASSERT_TRUE(responses.front().has_result()) << responses.front().error().message();
    tokens += responses.front().result().token_count();
  }

  // Exactly the four well-behaved micro-batches are in dW, once each.
  auto pulled = client_->PullGradient(head_.name, v1::DTYPE_FP32, false);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->summary.microbatch_count(), 4u);
  EXPECT_EQ(pulled->summary.token_count(), static_cast<uint64_t>(tokens));
  std::vector<double> want(static_cast<size_t>(kV * kD), 0.0);
  int64_t want_tokens = 0;
  for (const HostBatch& batch : batches) {
    const RefResult r =
        Reference(head_.weight, batch.hidden, batch.targets, kFullTokens, kD, kV, RefOptions{});
    for (size_t i = 0; i < want.size(); ++i) want[i] += r.grad_weight[i];
    want_tokens += r.token_count;
  }
  EXPECT_EQ(tokens, want_tokens);
  EXPECT_TRUE(
      AllClose(Decode(pulled->data, v1::DTYPE_FP32), want, ToleranceFor(v1::DTYPE_FP32).grad));

  // The stalls are counted, and the stalled calls ended ABORTED.
  const absl::StatusOr<Exposition> e =
      ScrapeWhen(server_->metrics_port(), "losshead_rpcs_total",
                 {{"method", "Step"}, {"code", "aborted"}}, 2);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->Sum("losshead_stalled_microbatches_total"), 2);
  EXPECT_EQ(e->Sum("losshead_rpcs_total", {{"method", "Step"}, {"code", "aborted"}}), 2);
}

TEST_F(StalledStreamTest, EarlierMicrobatchesAreAnsweredBeforeTheStalledStreamEnds) {
  // A stream sends one whole micro-batch, then the header of a second and nothing more: the first
  // is answered, then the call ends ABORTED; nothing of the second is counted.
  const HostBatch whole = MakeBatch(16, kD, kV, v1::DTYPE_FP32, 4);
  RawStream s(target_);
  v1::StepRequest first = Header(head_.name, "c", 1, 16);
  first.set_hidden(reinterpret_cast<const char*>(whole.hidden_bytes.data()),
                   whole.hidden_bytes.size());
  first.set_targets(reinterpret_cast<const char*>(whole.target_bytes.data()),
                    whole.target_bytes.size());
  first.set_last(true);
  ASSERT_TRUE(s.Write(first));
  ASSERT_TRUE(s.Write(Header(head_.name, "c", 2, 16)));
  s.ReadInBackground();
  const grpc::Status status = s.Ended();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  EXPECT_NE(status.error_message().find("sequence 2"), std::string::npos);
  const std::vector<v1::StepResponse> responses = s.responses();
  ASSERT_FALSE(responses.empty());
  EXPECT_TRUE(responses.front().has_result()) << responses.front().error().message();
  EXPECT_EQ(responses.front().sequence(), 1u);
  for (const auto& r : responses) EXPECT_EQ(r.sequence(), 1u);
  auto info = client_->GetHead(head_.name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), 1u);
  // The stalled sequence was never counted: sending it again computes it.
  auto progress = client_->GetClientProgress(head_.name, "c");
  ASSERT_TRUE(progress.ok());
  EXPECT_EQ(progress->acknowledged_sequence(), 1u);
  auto again = client_->Step(ToMicrobatch(head_.name, "c", 2, whole));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->replayed);
}

// Messages that bring no progress do not keep a micro-batch: two streams that send the header of
// the largest micro-batch (together they hold the whole byte bound) and then, four times per
// timeout, an empty message or a 4-byte piece are abandoned all the same, a timeout after their
// header, while they go on sending; an honest micro-batch refused meanwhile is then admitted, and
// dW holds it alone.
TEST_F(StalledStreamTest, KeepAliveMessagesDoNotHoldAMicrobatchPastTheTimeout) {
  const absl::Duration kEvery = kStall / 4;
  constexpr absl::Duration kKeepAliveFor = absl::Seconds(3);  // 15 timeouts
  std::vector<std::unique_ptr<RawStream>> streams;
  for (int i = 0; i < 2; ++i) streams.push_back(std::make_unique<RawStream>(target_));
  const absl::Time headers = absl::Now();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(
        streams[i]->Write(Header(head_.name, absl::StrCat("keepalive-", i), 1, kFullTokens)));
    streams[i]->ReadInBackground();
  }
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0};
  std::vector<std::thread> senders;
  for (int i = 0; i < 2; ++i) {
    senders.emplace_back([&, i] {
      v1::StepRequest empty;
      v1::StepRequest piece;
      piece.set_hidden(std::string(4, '\0'));
      for (int k = 0; !stop.load() && absl::Now() - headers < kKeepAliveFor; ++k) {
        absl::SleepFor(kEvery);
        if (!streams[i]->Write(k % 2 == 0 ? empty : piece)) return;  // the server ended the call
        sent.fetch_add(1);
      }
      streams[i]->WritesDone();
    });
  }

  const HostBatch honest = MakeBatch(100, kD, kV, v1::DTYPE_FP32, 9);
  absl::StatusOr<client::StepResult> got;
  int refused = 0;
  do {
    got = client_->Step(ToMicrobatch(head_.name, "honest", 1, honest));
    if (got.ok() || got.status().code() != absl::StatusCode::kResourceExhausted) break;
    ++refused;
  } while (absl::Now() - headers < kKeepAliveFor);
  const absl::Time answered = absl::Now();
  stop.store(true);
  for (std::thread& t : senders) t.join();
  ASSERT_TRUE(got.ok()) << got.status() << " (" << refused
                        << " refusals, while keep-alive messages held the byte bound)";
  EXPECT_LT(answered - headers, kKeepAliveFor);
  EXPECT_GT(sent.load(), 0);

  for (auto& s : streams) {
    const grpc::Status status = s->Ended();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
    EXPECT_NE(status.error_message().find("--step_stall_timeout=200ms"), std::string::npos)
        << status.error_message();
    EXPECT_NE(status.error_message().find("keepalive-"), std::string::npos);
    EXPECT_TRUE(s->responses().empty());
    EXPECT_GE(s->ended_at() - headers, kStall);
    EXPECT_LT(s->ended_at() - headers, kKeepAliveFor);
  }

  // Only the honest micro-batch is in dW.
  auto pulled = client_->PullGradient(head_.name, v1::DTYPE_FP32, false);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->summary.microbatch_count(), 1u);
  const RefResult want =
      Reference(head_.weight, honest.hidden, honest.targets, honest.n, kD, kV, RefOptions{});
  EXPECT_EQ(pulled->summary.token_count(), static_cast<uint64_t>(want.token_count));
  EXPECT_TRUE(AllClose(Decode(pulled->data, v1::DTYPE_FP32), want.grad_weight,
                       ToleranceFor(v1::DTYPE_FP32).grad));
  const absl::StatusOr<Exposition> e =
      ScrapeWhen(server_->metrics_port(), "losshead_rpcs_total",
                 {{"method", "Step"}, {"code", "aborted"}}, 2);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->Sum("losshead_stalled_microbatches_total"), 2);
}

// Progress is counted in bytes, not messages: with 4 KiB messages (3 KiB of payload each) and a
// 2 s timeout, a micro-batch sent in 2 KiB pieces every 150 ms takes 2.7 s in all but brings a
// message's payload every 300 ms; it is kept, answered and counted.
class SlowStreamTest : public StalledStreamTest {
 protected:
  static constexpr absl::Duration kTimeout = absl::Seconds(2);
  void Adjust(server::ServerOptions& options) override {
    options.max_message_bytes = 4 << 10;
    options.step_stall_timeout = kTimeout;
  }
};

TEST_F(SlowStreamTest, AMicrobatchThatArrivesSlowlyButSteadilyIsKept) {
  constexpr absl::Duration kEvery = absl::Milliseconds(150);
  constexpr size_t kPiece = 2 << 10;
  const HostBatch batch = MakeBatch(kFullTokens, kD, kV, v1::DTYPE_FP32, 21);
  RawStream s(target_);
  s.ReadInBackground();
  const absl::Time start = absl::Now();
  v1::StepRequest message = Header(head_.name, "slow", 1, kFullTokens);
  const auto* hidden = reinterpret_cast<const char*>(batch.hidden_bytes.data());
  const auto* targets = reinterpret_cast<const char*>(batch.target_bytes.data());
  const size_t hidden_bytes = batch.hidden_bytes.size();
  const size_t total = hidden_bytes + batch.target_bytes.size();
  for (size_t at = 0; at < total; at += kPiece) {
    if (at < hidden_bytes) {
      message.set_hidden(hidden + at, std::min(kPiece, hidden_bytes - at));
    } else {
      message.set_targets(targets + (at - hidden_bytes), std::min(kPiece, total - at));
    }
    message.set_last(at + kPiece >= total);
    ASSERT_TRUE(s.Write(message));
    message.Clear();
    if (at + kPiece < total) absl::SleepFor(kEvery);
  }
  s.WritesDone();
  const grpc::Status status = s.Ended();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_GT(absl::Now() - start, kTimeout);
  const std::vector<ReadAnswer> answers = Answers(s.responses());
  ASSERT_EQ(answers.size(), 1u);
  ASSERT_TRUE(answers[0].first.has_result()) << answers[0].first.error().message();
  ASSERT_TRUE(answers[0].complete);
  const RefResult want =
      Reference(head_.weight, batch.hidden, batch.targets, batch.n, kD, kV, RefOptions{});
  EXPECT_NEAR(answers[0].first.result().loss(), want.loss,
              ToleranceFor(v1::DTYPE_FP32).loss_rel * std::abs(want.loss));
  client::Bytes grad(answers[0].grad_hidden.size());
  std::memcpy(grad.data(), answers[0].grad_hidden.data(), grad.size());
  EXPECT_TRUE(
      AllClose(Decode(grad, v1::DTYPE_FP32), want.grad_hidden, ToleranceFor(v1::DTYPE_FP32).grad));
  auto info = client_->GetHead(head_.name);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->microbatches_total(), 1u);
}

}  // namespace
}  // namespace losshead::testing
