// Every bad input gets its exact status code and changes nothing. Per-micro-batch errors come back
// as the micro-batch's status and the stream stays usable; malformed streams end the call.
#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "tests/service/host_tensors.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr size_t kLimit = size_t{256} << 10;
constexpr int64_t kN = 16, kD = 8, kV = 19;

class ErrorsTest : public SharedServerTest<kLimit> {
 protected:
  void SetUp() override {
    SharedServerTest::SetUp();
    if (HasFatalFailure()) return;
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    auto head = CreateKnownHead(*client_, name, kV, kD, v1::DTYPE_FP32, 1);
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;
    good_ = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 2);
    auto stream = client_->OpenStepStream();
    ASSERT_TRUE(stream.ok());
    stream_ = std::move(*stream);
  }
  void TearDown() override {
    if (stream_ != nullptr) stream_->Cancel();
  }

  client::Microbatch Good(uint64_t sequence) const {
    return ToMicrobatch(head_.name, "errors", sequence, good_);
  }

  // What a bad input must leave untouched: counters, version, accumulated dW and W.
  struct Snapshot {
    v1::HeadInfo info;
    client::PulledGradient gradient;
    client::DownloadedWeights weights;
  };
  Snapshot Take() {
    Snapshot s;
    auto info = client_->GetHead(head_.name);
    auto gradient = client_->PullGradient(head_.name, v1::DTYPE_FP32, false);
    auto weights = client_->DownloadWeights(head_.name);
    EXPECT_TRUE(info.ok() && gradient.ok() && weights.ok());
    if (info.ok()) s.info = *info;
    if (gradient.ok()) s.gradient = *gradient;
    if (weights.ok()) s.weights = *weights;
    return s;
  }
  void ExpectSame(const Snapshot& before) {
    const Snapshot now = Take();
    EXPECT_EQ(now.info.weights_version(), before.info.weights_version());
    EXPECT_EQ(now.info.tokens_since_pull(), before.info.tokens_since_pull());
    EXPECT_EQ(now.info.microbatches_since_pull(), before.info.microbatches_since_pull());
    EXPECT_EQ(now.info.tokens_total(), before.info.tokens_total());
    EXPECT_EQ(now.info.microbatches_total(), before.info.microbatches_total());
    EXPECT_EQ(now.gradient.summary.token_count(), before.gradient.summary.token_count());
    EXPECT_EQ(now.gradient.data, before.gradient.data);
    EXPECT_EQ(now.weights.data, before.weights.data);
  }
  // A head nothing has touched since its upload: pull shows no tokens, version as uploaded.
  void ExpectHeadPristine() {
    const Snapshot now = Take();
    EXPECT_EQ(now.info.weights_version(), head_.version);
    EXPECT_EQ(now.info.tokens_total(), 0u);
    EXPECT_EQ(now.info.microbatches_total(), 0u);
    EXPECT_EQ(now.gradient.summary.token_count(), 0u);
    EXPECT_EQ(now.gradient.summary.microbatch_count(), 0u);
    for (float x : Decode(now.gradient.data, v1::DTYPE_FP32)) ASSERT_EQ(x, 0.0f);
    EXPECT_EQ(Decode(now.weights.data, v1::DTYPE_FP32), head_.weight);
  }

  // Sends `mb` on the shared stream, expects `code` as its answer, checks that the head did not
  // change, then shows that the same stream still serves a good micro-batch.
  void ExpectMicrobatchError(const client::Microbatch& mb, absl::StatusCode code) {
    const Snapshot before = Take();
    ASSERT_TRUE(stream_->Send(mb).ok());
    auto got = stream_->Receive();
    EXPECT_EQ(got.status().code(), code) << got.status();
    ExpectSame(before);
    if (before.info.tokens_total() == 0) ExpectHeadPristine();
    ASSERT_TRUE(stream_->Send(Good(1000 + ++good_steps_)).ok());
    auto good = stream_->Receive();
    EXPECT_TRUE(good.ok()) << "stream unusable after the error: " << good.status();
  }

  KnownHead head_;
  HostBatch good_;
  std::unique_ptr<client::StepStream> stream_;
  int good_steps_ = 0;
};

TEST_F(ErrorsTest, UnknownHeadIsNotFound) {
  client::Microbatch mb = Good(1);
  mb.head = "no-such-head";
  ExpectMicrobatchError(mb, absl::StatusCode::kNotFound);
}

TEST_F(ErrorsTest, HiddenByteLengthWrongIsInvalidArgument) {
  client::Microbatch mb = Good(1);
  mb.hidden = mb.hidden.first(mb.hidden.size() - 4);
  ExpectMicrobatchError(mb, absl::StatusCode::kInvalidArgument);
}

TEST_F(ErrorsTest, TargetByteLengthWrongIsInvalidArgument) {
  client::Microbatch mb = Good(1);
  mb.targets = mb.targets.first(mb.targets.size() - 4);
  ExpectMicrobatchError(mb, absl::StatusCode::kInvalidArgument);
}

TEST_F(ErrorsTest, NumTokensDisagreeingWithBytesIsInvalidArgument) {
  client::Microbatch mb = Good(1);
  mb.num_tokens = kN + 1;
  ExpectMicrobatchError(mb, absl::StatusCode::kInvalidArgument);
}

TEST_F(ErrorsTest, HiddenDtypeNotAllowedIsInvalidArgument) {
  client::Microbatch mb = Good(1);
  mb.hidden_dtype = v1::DTYPE_INT32;  // same byte size as fp32: only the dtype is wrong
  ExpectMicrobatchError(mb, absl::StatusCode::kInvalidArgument);
  mb.hidden_dtype = v1::DTYPE_UNSPECIFIED;
  mb.sequence = 2;
  ExpectMicrobatchError(mb, absl::StatusCode::kInvalidArgument);
}

TEST_F(ErrorsTest, TargetDtypeNotAllowedIsInvalidArgument) {
  client::Microbatch mb = Good(1);
  mb.target_dtype = v1::DTYPE_FP32;  // same byte size as int32
  ExpectMicrobatchError(mb, absl::StatusCode::kInvalidArgument);
}

TEST_F(ErrorsTest, GradHiddenDtypeNotAllowedIsInvalidArgument) {
  client::Microbatch mb = Good(1);
  mb.options.set_grad_hidden_dtype(v1::DTYPE_INT64);
  ExpectMicrobatchError(mb, absl::StatusCode::kInvalidArgument);
}

TEST_F(ErrorsTest, TargetOutOfRangeIsInvalidArgument) {
  HostBatch bad = good_;
  std::vector<int64_t> targets = bad.targets;
  targets[3] = kV;  // one past the vocabulary
  SetTargets(bad, targets);
  ExpectMicrobatchError(ToMicrobatch(head_.name, "errors", 1, bad),
                        absl::StatusCode::kInvalidArgument);
  targets[3] = -5;  // negative and not the ignore_index
  SetTargets(bad, targets);
  ExpectMicrobatchError(ToMicrobatch(head_.name, "errors", 2, bad),
                        absl::StatusCode::kInvalidArgument);
}

TEST_F(ErrorsTest, NanOrInfInHiddenIsInvalidArgument) {
  uint64_t sequence = 0;
  for (float poison :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    HostBatch bad = good_;
    bad.hidden[kD + 3] = poison;
    bad.hidden_bytes = Encode(bad.hidden, v1::DTYPE_FP32);
    ExpectMicrobatchError(ToMicrobatch(head_.name, "errors", ++sequence, bad),
                          absl::StatusCode::kInvalidArgument);
  }
}

TEST_F(ErrorsTest, ZeroTokensIsInvalidArgument) {
  client::Microbatch mb = Good(1);
  mb.num_tokens = 0;
  mb.hidden = {};
  mb.targets = {};
  ExpectMicrobatchError(mb, absl::StatusCode::kInvalidArgument);
}

TEST_F(ErrorsTest, InvalidLossOverridesAreInvalidArgument) {
  client::Microbatch mb = Good(1);
  mb.loss_options.set_label_smoothing(1.5f);
  ExpectMicrobatchError(mb, absl::StatusCode::kInvalidArgument);
  mb = Good(2);
  mb.loss_options.set_z_loss(-1.0f);
  ExpectMicrobatchError(mb, absl::StatusCode::kInvalidArgument);
}

TEST_F(ErrorsTest, WrongExpectedWeightsVersionIsFailedPrecondition) {
  client::Microbatch mb = Good(1);
  mb.options.set_expected_weights_version(head_.version + 1);
  ExpectMicrobatchError(mb, absl::StatusCode::kFailedPrecondition);
}

TEST_F(ErrorsTest, MessageOverTheLimitIsResourceExhausted) {
  // A client that believes in a 1 MiB limit sends 512 KiB in one message to a 256 KiB server.
  auto big_client = server_->NewClient(size_t{1} << 20, /*same_node=*/false);
  const int64_t n = 2048, d = kD * 8;  // 2048 x 64 fp32 = 512 KiB
  auto big_head = CreateKnownHead(*client_, "big-" + head_.name, kV, d, v1::DTYPE_FP32, 3);
  ASSERT_TRUE(big_head.ok()) << big_head.status();
  const HostBatch big = MakeBatch(n, d, kV, v1::DTYPE_FP32, 4);
  auto stream = big_client->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  (void)(*stream)->Send(ToMicrobatch(big_head->name, "big", 1, big));
  auto got = (*stream)->Receive();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  EXPECT_EQ((*stream)->Finish().code(), absl::StatusCode::kResourceExhausted);
  auto info = client_->GetHead(big_head->name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens_total(), 0u);
  EXPECT_EQ(info->weights_version(), big_head->version);
  // The server is fine: a right-sized client steps the same micro-batch.
  auto ok = client_->Step(ToMicrobatch(big_head->name, "big", 1, big));
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST_F(ErrorsTest, PushWithWrongShapeOrDtypeIsInvalidArgument) {
  const client::Bytes weights = Encode(head_.weight, v1::DTYPE_FP32);
  client::PushRequest push{.head = head_.name, .dtype = v1::DTYPE_FP32};
  push.data = std::span<const std::byte>(weights).first(weights.size() - 4 * kD);  // one row short
  EXPECT_EQ(client_->PushWeights(push).status().code(), absl::StatusCode::kInvalidArgument);
  push.data = weights;
  push.dtype = v1::DTYPE_BF16;  // V x D x 2 bytes expected, V x D x 4 given
  EXPECT_EQ(client_->PushWeights(push).status().code(), absl::StatusCode::kInvalidArgument);
  push.dtype = v1::DTYPE_INT32;
  EXPECT_EQ(client_->PushWeights(push).status().code(), absl::StatusCode::kInvalidArgument);
  push.dtype = v1::DTYPE_FP32;
  push.data = {};
  EXPECT_EQ(client_->PushWeights(push).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> poisoned = head_.weight;
  poisoned[5] = std::numeric_limits<float>::quiet_NaN();
  const client::Bytes poisoned_bytes = Encode(poisoned, v1::DTYPE_FP32);
  push.data = poisoned_bytes;
  EXPECT_EQ(client_->PushWeights(push).status().code(), absl::StatusCode::kInvalidArgument);
  push.data = weights;
  push.expected_weights_version = head_.version + 5;
  EXPECT_EQ(client_->PushWeights(push).status().code(), absl::StatusCode::kFailedPrecondition);
  push.head = "no-such-head";
  push.expected_weights_version.reset();
  EXPECT_EQ(client_->PushWeights(push).status().code(), absl::StatusCode::kNotFound);
  ExpectHeadPristine();
}

TEST_F(ErrorsTest, HeadManagementErrorsHaveExactCodes) {
  v1::HeadSpec spec;
  spec.set_name(head_.name);
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  EXPECT_EQ(client_->CreateHead(spec).status().code(), absl::StatusCode::kAlreadyExists);
  ExpectHeadPristine();

  spec.set_name("bad name!");
  EXPECT_EQ(client_->CreateHead(spec).status().code(), absl::StatusCode::kInvalidArgument);
  spec.set_name("");
  EXPECT_EQ(client_->CreateHead(spec).status().code(), absl::StatusCode::kInvalidArgument);
  spec.set_name("zero-vocab");
  spec.set_vocab_size(0);
  EXPECT_EQ(client_->CreateHead(spec).status().code(), absl::StatusCode::kInvalidArgument);
  spec.set_vocab_size(kV);
  spec.set_weight_dtype(v1::DTYPE_INT32);
  EXPECT_EQ(client_->CreateHead(spec).status().code(), absl::StatusCode::kInvalidArgument);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_init()->mutable_normal()->set_std(-1.0f);
  EXPECT_EQ(client_->CreateHead(spec).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->GetHead("zero-vocab").status().code(), absl::StatusCode::kNotFound);

  EXPECT_EQ(client_->GetHead("no-such-head").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->DeleteHead("no-such-head").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->PullGradient("no-such-head").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->DownloadWeights("no-such-head").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->SetLossOptions("no-such-head", {}).status().code(),
            absl::StatusCode::kNotFound);
  v1::LossOptions bad;
  bad.set_label_smoothing(1.0f);
  EXPECT_EQ(client_->SetLossOptions(head_.name, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->PullGradient(head_.name, v1::DTYPE_FP16).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->PullGradient(head_.name, v1::DTYPE_INT32).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->DownloadWeights(head_.name, v1::DTYPE_INT64).status().code(),
            absl::StatusCode::kInvalidArgument);
  ExpectHeadPristine();
}

// Malformed streams, written message by message with the generated stub.
class MalformedStreamTest : public ErrorsTest {
 protected:
  absl::StatusCode RunRaw(const std::vector<v1::StepRequest>& messages) {
    auto channel = grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials());
    auto stub = v1::LossHead::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto stream = stub->Step(&context);
    for (const v1::StepRequest& m : messages) {
      if (!stream->Write(m)) break;
    }
    stream->WritesDone();
    v1::StepResponse response;
    while (stream->Read(&response)) {
    }
    return static_cast<absl::StatusCode>(stream->Finish().error_code());
  }

  v1::StepRequest First(bool last, size_t hidden_bytes) const {
    v1::StepRequest r;
    v1::StepHeader* h = r.mutable_header();
    h->set_head(head_.name);
    h->set_client_id("raw");
    h->set_sequence(1);
    h->set_num_tokens(kN);
    h->set_hidden_dtype(v1::DTYPE_FP32);
    h->set_target_dtype(v1::DTYPE_INT32);
    r.set_hidden(reinterpret_cast<const char*>(good_.hidden_bytes.data()), hidden_bytes);
    if (last) {
      r.set_targets(reinterpret_cast<const char*>(good_.target_bytes.data()),
                    good_.target_bytes.size());
    }
    r.set_last(last);
    return r;
  }
};

TEST_F(MalformedStreamTest, StreamEndingInsideAMicrobatchIsInvalidArgument) {
  EXPECT_EQ(RunRaw({First(false, good_.hidden_bytes.size() / 2)}),
            absl::StatusCode::kInvalidArgument);
  ExpectHeadPristine();
}

TEST_F(MalformedStreamTest, DataOutsideAMicrobatchIsInvalidArgument) {
  v1::StepRequest orphan;
  orphan.set_hidden("abcd");
  orphan.set_last(true);
  EXPECT_EQ(RunRaw({orphan}), absl::StatusCode::kInvalidArgument);
  ExpectHeadPristine();
}

TEST_F(MalformedStreamTest, HeaderInsideAMicrobatchIsInvalidArgument) {
  const size_t half = good_.hidden_bytes.size() / 2;
  EXPECT_EQ(RunRaw({First(false, half), First(true, half)}), absl::StatusCode::kInvalidArgument);
  ExpectHeadPristine();
}

TEST_F(MalformedStreamTest, WellFormedRawStreamIsOk) {
  // The control: the same helper with a complete micro-batch ends OK.
  EXPECT_EQ(RunRaw({First(true, good_.hidden_bytes.size())}), absl::StatusCode::kOk);
}

}  // namespace
}  // namespace losshead::testing
