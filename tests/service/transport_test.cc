// Chunking, pipelining and concurrency on a server whose message limit (64 KiB) is smaller than
// the tensors: micro-batches span several messages, dH and dW come back in several chunks.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr size_t kLimit = size_t{64} << 10;

// The client's limit equals the server's, so any answer message over 64 KiB fails the call.
class TransportTest : public SharedServerTest<kLimit> {
 protected:
  static std::vector<double> Sum(const std::vector<std::vector<double>>& parts) {
    std::vector<double> sum(parts.at(0).size(), 0.0);
    for (const auto& p : parts) {
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += p[i];
    }
    return sum;
  }
};

// hidden 300 x 96 fp32 = 112.5 KiB, dH the same, dW 257 x 96 fp32 = 96.4 KiB: all above 64 KiB.
constexpr int64_t kN = 300, kD = 96, kV = 257;

TEST_F(TransportTest, Fp32MicrobatchLargerThanMessageLimitSplitsAndChunksBack) {
  auto head = CreateKnownHead(*client_, "chunked", kV, kD, v1::DTYPE_FP32, 1);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 2, /*ignore_every=*/7);
  client::Microbatch mb = ToMicrobatch(head->name, "c", 1, batch);
  mb.options.set_return_per_token_loss(true);
  auto got = client_->Step(mb);
  ASSERT_TRUE(got.ok()) << got.status();
  const RefResult want = Reference(head->weight, batch.hidden, batch.targets, kN, kD, kV, {});
  EXPECT_EQ(got->token_count, want.token_count);
  EXPECT_NEAR(got->loss, want.loss, 1e-5 * want.loss);
  EXPECT_TRUE(AllClose(Decode(got->grad_hidden, v1::DTYPE_FP32), want.grad_hidden, 1e-4));
  EXPECT_TRUE(AllClose(got->per_token_loss, want.per_token_loss, 1e-5));

  auto pulled = client_->PullGradient(head->name, v1::DTYPE_FP32, true);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_TRUE(AllClose(Decode(pulled->data, v1::DTYPE_FP32), want.grad_weight, 1e-4));

  // A bf16 pull is the fp32 dW rounded; the accumulator was reset, so it is now all zeros.
  auto empty = client_->PullGradient(head->name, v1::DTYPE_BF16, false);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->summary.token_count(), 0u);
  EXPECT_EQ(empty->data.size(), static_cast<size_t>(kV * kD * 2));
  for (float x : Decode(empty->data, v1::DTYPE_BF16)) ASSERT_EQ(x, 0.0f);
}

TEST_F(TransportTest, WeightsUploadDownloadAndAddRoundTripInChunks) {
  auto head = CreateKnownHead(*client_, "weights", kV, kD, v1::DTYPE_FP32, 3);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(head->version, 2u);  // 1 at creation, +1 for the upload

  auto down = client_->DownloadWeights(head->name);
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_EQ(down->vocab_size, kV);
  EXPECT_EQ(down->hidden_size, kD);
  EXPECT_EQ(down->dtype, v1::DTYPE_FP32);
  EXPECT_EQ(down->weights_version, 2u);
  EXPECT_EQ(Decode(down->data, v1::DTYPE_FP32), head->weight);

  const std::vector<float> delta = RandomValues(head->weight.size(), 0.1, v1::DTYPE_FP32, 4);
  const client::Bytes encoded = Encode(delta, v1::DTYPE_FP32);
  client::PushRequest push{.head = head->name,
                           .dtype = v1::DTYPE_FP32,
                           .data = encoded,
                           .mode = v1::PUSH_MODE_ADD,
                           .expected_weights_version = 2};
  auto version = client_->PushWeights(push);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 3u);

  auto after = client_->DownloadWeights(head->name, v1::DTYPE_FP32);
  ASSERT_TRUE(after.ok()) << after.status();
  const std::vector<float> got = Decode(after->data, v1::DTYPE_FP32);
  ASSERT_EQ(got.size(), head->weight.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], head->weight[i] + delta[i]) << i;

  // bf16 download of fp32 weights: rounded to nearest even.
  auto bf16 = client_->DownloadWeights(head->name, v1::DTYPE_BF16);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->dtype, v1::DTYPE_BF16);
  EXPECT_EQ(Decode(bf16->data, v1::DTYPE_BF16),
            Decode(Encode(got, v1::DTYPE_BF16), v1::DTYPE_BF16));
}

TEST_F(TransportTest, PipelinedMicrobatchesOnOneStreamAnswerInOrder) {
  constexpr int kCount = 6;
  auto head = CreateKnownHead(*client_, "pipelined", kV, kD, v1::DTYPE_BF16, 5);
  ASSERT_TRUE(head.ok()) << head.status();
  std::vector<HostBatch> batches;
  std::vector<RefResult> wants;
  for (int i = 0; i < kCount; ++i) {
    // Sizes differ so that a mix-up of answers could not go unnoticed.
    batches.push_back(MakeBatch(100 + 40 * i, kD, kV, v1::DTYPE_BF16, 100 + i, 4));
    wants.push_back(Reference(head->weight, batches[i].hidden, batches[i].targets, batches[i].n, kD,
                              kV, RefOptions{.reduction = v1::REDUCTION_SUM}));
  }
  auto stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (int i = 0; i < kCount; ++i) {
    client::Microbatch mb = ToMicrobatch(head->name, "pipe", 10 + i, batches[i]);
    mb.options.set_reduction(v1::REDUCTION_SUM);
    ASSERT_TRUE((*stream)->Send(mb).ok());
  }
  EXPECT_EQ((*stream)->outstanding(), static_cast<size_t>(kCount));
  const Tolerance tol = ToleranceFor(v1::DTYPE_BF16);
  std::vector<std::vector<double>> dws;
  for (int i = 0; i < kCount; ++i) {
    auto got = (*stream)->Receive();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->sequence, static_cast<uint64_t>(10 + i));
    EXPECT_EQ(got->token_count, wants[i].token_count);
    EXPECT_NEAR(got->loss_sum, wants[i].loss_sum, tol.loss_rel * wants[i].loss_sum);
    EXPECT_TRUE(
        AllClose(Decode(got->grad_hidden, v1::DTYPE_BF16), wants[i].grad_hidden, 2 * tol.grad));
    dws.push_back(wants[i].grad_weight);
  }
  EXPECT_EQ((*stream)->Receive().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*stream)->Finish().ok());

  auto pulled = client_->PullGradient(head->name, v1::DTYPE_FP32, true);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->summary.microbatch_count(), static_cast<uint64_t>(kCount));
  EXPECT_TRUE(AllClose(Decode(pulled->data, v1::DTYPE_FP32), Sum(dws), tol.grad));
}

// Every micro-batch given to Send is answered by Receive, also when Send finds the call already
// over: StepMany counts a refused one as sent and re-sends it on a new stream after a drop.
TEST_F(TransportTest, SendOnAnEndedCallIsStillAnsweredByReceive) {
  auto head = CreateKnownHead(*client_, "ended", kV, kD, v1::DTYPE_FP32, 6);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(4, kD, kV, v1::DTYPE_FP32, 7, 0);
  auto stream = client_->OpenStepStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  (*stream)->Cancel();
  // Sends until one is refused (a refused write waits for the end of the call), then once more:
  // that one finds the call ended before writing anything.
  uint64_t sent = 0;
  absl::Status refused;
  while (refused.ok() && sent < 100) {
    refused = (*stream)->Send(ToMicrobatch(head->name, "ended", ++sent, batch));
  }
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ((*stream)->Send(ToMicrobatch(head->name, "ended", ++sent, batch)).code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ((*stream)->outstanding(), sent);
  for (uint64_t i = 0; i < sent; ++i) {
    EXPECT_EQ((*stream)->Receive().status().code(), absl::StatusCode::kCancelled) << i;
  }
  EXPECT_EQ((*stream)->Receive().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(TransportTest, ConcurrentStreamsAccumulateIntoOneGradient) {
  constexpr int kStreams = 4, kPerStream = 3;
  constexpr int64_t n = 64, d = 32, v = 97;
  auto head = CreateKnownHead(*client_, "concurrent", v, d, v1::DTYPE_FP32, 6);
  ASSERT_TRUE(head.ok()) << head.status();
  std::vector<std::vector<HostBatch>> batches(kStreams);
  std::vector<std::vector<double>> dws;
  int64_t tokens = 0;
  for (int s = 0; s < kStreams; ++s) {
    for (int i = 0; i < kPerStream; ++i) {
      batches[s].push_back(MakeBatch(n, d, v, v1::DTYPE_FP32, 1000 + 10 * s + i, 5));
      const RefResult r = Reference(head->weight, batches[s][i].hidden, batches[s][i].targets, n, d,
                                    v, RefOptions{});
      tokens += r.token_count;
      dws.push_back(r.grad_weight);
    }
  }
  std::vector<absl::Status> statuses(kStreams);
  std::vector<std::thread> threads;
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      auto client = server_->NewClient(kLimit);
      auto stream = client->OpenStepStream();
      if (!stream.ok()) {
        statuses[s] = stream.status();
        return;
      }
      for (int i = 0; i < kPerStream; ++i) {
        absl::Status sent = (*stream)->Send(
            ToMicrobatch(head->name, absl::StrCat("stream", s), i + 1, batches[s][i]));
        if (!sent.ok()) statuses[s] = sent;
      }
      for (int i = 0; i < kPerStream; ++i) {
        auto got = (*stream)->Receive();
        if (!got.ok()) statuses[s] = got.status();
      }
      absl::Status finished = (*stream)->Finish();
      if (statuses[s].ok()) statuses[s] = finished;
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;

  auto pulled = client_->PullGradient(head->name, v1::DTYPE_FP32, true);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->summary.token_count(), static_cast<uint64_t>(tokens));
  EXPECT_EQ(pulled->summary.microbatch_count(), static_cast<uint64_t>(kStreams * kPerStream));
  EXPECT_TRUE(AllClose(Decode(pulled->data, v1::DTYPE_FP32), Sum(dws), 1e-4));
}

}  // namespace
}  // namespace losshead::testing
