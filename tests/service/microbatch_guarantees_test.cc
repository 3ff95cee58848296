// What a sent micro-batch is owed, end to end: a key reused for other content is refused
// (ALREADY_EXISTS, counted as its own failure reason) and the original still replays; a header the
// server can never serve is answered before any of its data is read, and the stream goes on.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kN = 12, kD = 8, kV = 23;

class MicrobatchGuaranteesTest
    : public SharedServerTest<kTestServerMessageBytes, /*kMetrics=*/true> {
 protected:
  void SetUp() override {
    SharedServerTest::SetUp();
    if (HasFatalFailure()) return;
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    auto head = CreateKnownHead(*client_, name, kV, kD, v1::DTYPE_FP32, 5);
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;
    batch_ = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 6);
  }

  struct Counted {
    uint64_t microbatches = 0;
    uint64_t tokens = 0;
    client::Bytes gradient;
    bool operator==(const Counted&) const = default;
  };
  Counted Now() {
    Counted c;
    auto info = client_->GetHead(head_.name);
    auto pulled = client_->PullGradient(head_.name, v1::DTYPE_FP32, false);
    EXPECT_TRUE(info.ok() && pulled.ok());
    if (info.ok()) {
      c.microbatches = info->microbatches_total();
      c.tokens = info->tokens_total();
    }
    if (pulled.ok()) {
      EXPECT_EQ(pulled->summary.microbatch_count(), c.microbatches);
      c.gradient = pulled->data;
    }
    return c;
  }

  double Scrape(const std::string& name, const std::map<std::string, std::string>& labels) {
    return ScrapeSum(server_->metrics_port(), name, labels);
  }

  // A Step stream written message by message with the generated stub.
  struct RawStream {
    grpc::ClientContext context;
    std::unique_ptr<v1::LossHead::Stub> stub;
    std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> stream;
  };
  std::unique_ptr<RawStream> OpenRaw() {
    auto raw = std::make_unique<RawStream>();
    raw->stub = v1::LossHead::NewStub(
        grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
    raw->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    raw->stream = raw->stub->Step(&raw->context);
    return raw;
  }
  // The header message of batch_ as sequence `sequence`, announcing everything, carrying nothing.
  v1::StepRequest Header(uint64_t sequence) const {
    v1::StepRequest r;
    v1::StepHeader* h = r.mutable_header();
    h->set_head(head_.name);
    h->set_client_id("raw");
    h->set_sequence(sequence);
    h->set_num_tokens(kN);
    h->set_hidden_dtype(v1::DTYPE_FP32);
    h->set_target_dtype(v1::DTYPE_INT32);
    return r;
  }
  v1::StepRequest Data(bool with_header, uint64_t sequence) const {
    v1::StepRequest r = with_header ? Header(sequence) : v1::StepRequest();
    r.set_hidden(reinterpret_cast<const char*>(batch_.hidden_bytes.data()),
                 batch_.hidden_bytes.size());
    r.set_targets(reinterpret_cast<const char*>(batch_.target_bytes.data()),
                  batch_.target_bytes.size());
    r.set_last(true);
    return r;
  }

  KnownHead head_;
  HostBatch batch_;
};

TEST_F(MicrobatchGuaranteesTest, ReusedKeyWithOtherContentIsAlreadyExistsAndCountsNothing) {
  const client::Microbatch original = ToMicrobatch(head_.name, "reuse", 1, batch_);
  auto first = client_->Step(original);
  ASSERT_TRUE(first.ok()) << first.status();
  const Counted counted = Now();
  const double refused_before =
      Scrape("losshead_failures_total", {{"method", "Step"}, {"reason", "already_exists"}});

  const HostBatch other = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 7);
  struct Change {
    const char* what;
    std::function<void(client::Microbatch&)> edit;
  };
  const std::vector<Change> changes = {
      {"hidden", [&](client::Microbatch& mb) { mb.hidden = other.hidden_bytes; }},
      {"targets", [&](client::Microbatch& mb) { mb.targets = other.target_bytes; }},
      {"options", [](client::Microbatch& mb) { mb.options.set_return_per_token_loss(true); }},
      {"loss_options", [](client::Microbatch& mb) { mb.loss_options.set_z_loss(1e-4f); }},
  };
  for (const Change& change : changes) {
    client::Microbatch repeat = original;
    change.edit(repeat);
    auto got = client_->Step(repeat);
    ASSERT_EQ(got.status().code(), absl::StatusCode::kAlreadyExists) << change.what;
    const std::string message(got.status().message());
    EXPECT_NE(message.find("sequence 1 of client 'reuse'"), std::string::npos) << message;
    EXPECT_NE(message.find(change.what), std::string::npos) << message;
    EXPECT_TRUE(Now() == counted) << change.what << ": the refusal changed the head";
  }
  // The key still answers what it was first used for.
  auto replay = client_->Step(original);
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->replayed);
  EXPECT_EQ(replay->loss_sum, first->loss_sum);
  EXPECT_EQ(replay->grad_hidden, first->grad_hidden);
  EXPECT_TRUE(Now() == counted);
  EXPECT_EQ(Scrape("losshead_failures_total", {{"method", "Step"}, {"reason", "already_exists"}}),
            refused_before + changes.size());
  EXPECT_EQ(Scrape("losshead_microbatches_total", {{"head", head_.name}, {"outcome", "error"}}),
            changes.size());
}

TEST_F(MicrobatchGuaranteesTest, ImpossibleHeadersAreAnsweredBeforeAnyData) {
  struct Bad {
    const char* what;
    absl::StatusCode code;
    std::function<void(v1::StepHeader&)> edit;
  };
  const std::vector<Bad> bad = {
      {"2^40 tokens", absl::StatusCode::kResourceExhausted,
       [](auto& h) { h.set_num_tokens(int64_t{1} << 40); }},
      {"0 tokens", absl::StatusCode::kInvalidArgument, [](auto& h) { h.set_num_tokens(0); }},
      {"negative tokens", absl::StatusCode::kInvalidArgument,
       [](auto& h) { h.set_num_tokens(-5); }},
      {"unknown head", absl::StatusCode::kNotFound, [](auto& h) { h.set_head("no-such-head"); }},
      {"integer hidden", absl::StatusCode::kInvalidArgument,
       [](auto& h) { h.set_hidden_dtype(v1::DTYPE_INT32); }},
      {"float targets", absl::StatusCode::kInvalidArgument,
       [](auto& h) { h.set_target_dtype(v1::DTYPE_FP32); }},
      {"integer dH", absl::StatusCode::kInvalidArgument,
       [](auto& h) { h.mutable_options()->set_grad_hidden_dtype(v1::DTYPE_INT64); }},
      {"label smoothing 1.5", absl::StatusCode::kInvalidArgument,
       [](auto& h) { h.mutable_loss_options()->set_label_smoothing(1.5f); }},
  };
  const Counted before = Now();
  auto raw = OpenRaw();
  uint64_t sequence = 0;
  for (const Bad& b : bad) {
    v1::StepRequest header = Header(++sequence);
    b.edit(*header.mutable_header());
    const absl::Time sent = absl::Now();
    ASSERT_TRUE(raw->stream->Write(header)) << b.what;
    // Nothing of its data is sent: an answer can only come from the header.
    v1::StepResponse response;
    ASSERT_TRUE(raw->stream->Read(&response)) << b.what << ": no answer before the data";
    EXPECT_LT(absl::Now() - sent, absl::Seconds(10)) << b.what;
    ASSERT_TRUE(response.has_error()) << b.what;
    EXPECT_EQ(response.error().code(), static_cast<int>(b.code))
        << b.what << ": " << response.error().message();
    EXPECT_EQ(response.error().retry_after_ms(), 0u) << b.what << ": it can never be admitted";
    EXPECT_EQ(response.sequence(), sequence);
    EXPECT_EQ(response.client_id(), "raw");
    EXPECT_TRUE(response.last());
    // The rest of it is left out: the next header comes right away.
  }
  // A refused micro-batch whose rest is sent anyway: its pieces are skipped.
  v1::StepRequest header = Header(++sequence);
  header.mutable_header()->set_num_tokens(0);
  ASSERT_TRUE(raw->stream->Write(header));
  v1::StepResponse response;
  ASSERT_TRUE(raw->stream->Read(&response));
  EXPECT_EQ(response.error().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  ASSERT_TRUE(raw->stream->Write(Data(false, sequence)));
  // The stream still serves a good micro-batch, counted once.
  ASSERT_TRUE(raw->stream->Write(Data(true, ++sequence)));
  ASSERT_TRUE(raw->stream->Read(&response));
  ASSERT_TRUE(response.has_result()) << response.error().message();
  EXPECT_EQ(response.sequence(), sequence);
  while (!response.last()) ASSERT_TRUE(raw->stream->Read(&response));
  // A stream may end right after a refused header (its rest omitted): the call ends OK.
  header = Header(++sequence);
  header.mutable_header()->set_head("no-such-head");
  ASSERT_TRUE(raw->stream->Write(header));
  ASSERT_TRUE(raw->stream->Read(&response));
  EXPECT_EQ(response.error().code(), static_cast<int>(absl::StatusCode::kNotFound));
  raw->stream->WritesDone();
  EXPECT_FALSE(raw->stream->Read(&response));
  const grpc::Status finished = raw->stream->Finish();
  EXPECT_TRUE(finished.ok()) << finished.error_message();

  const Counted after = Now();
  EXPECT_EQ(after.microbatches, before.microbatches + 1);
  EXPECT_EQ(after.tokens, before.tokens + kN);
}

}  // namespace
}  // namespace losshead::testing
