// The C++ client's transfers of a head with an output bias against a real server: PushRequest.bias
// goes after W in one stream (pieces that straddle W's end under a small message limit), and the
// whole-tensor DownloadWeights and PullGradient hand b and db back in `bias`, bit for bit, in the
// head's dtype or another; a bf16 W with its fp32 b; a head without a bias leaves `bias` empty.
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kV = 37, kD = 19;  // W is 2812 bytes in fp32: several pieces of under 1 KiB

// Messages of 1 KiB: the push's pieces and the download's chunks both cut W and b.
class BiasTransfersTest : public SharedServerTest<1 << 10> {
 protected:
  void CreateBiasHead(const std::string& name, v1::DType dtype, bool bias = true) {
    v1::HeadSpec spec;
    spec.set_name(name);
    spec.set_vocab_size(kV);
    spec.set_hidden_size(kD);
    spec.set_weight_dtype(dtype);
    spec.set_bias(bias);
    spec.mutable_init()->set_zeros(true);
    auto info = client_->CreateHead(spec);
    ASSERT_TRUE(info.ok()) << info.status();
  }
};

TEST_F(BiasTransfersTest, PushDownloadAndPullCarryBiasBitForBit) {
  CreateBiasHead("b32", v1::DTYPE_FP32);
  const std::vector<float> w = RandomValues(kV * kD, 0.7, v1::DTYPE_FP32, 1);
  const std::vector<float> b = RandomValues(kV, 2.0, v1::DTYPE_FP32, 2);
  const client::Bytes w_bytes = Encode(w, v1::DTYPE_FP32), b_bytes = Encode(b, v1::DTYPE_FP32);
  client::PushRequest push{.head = "b32", .dtype = v1::DTYPE_FP32, .data = w_bytes};
  push.bias = b_bytes;
  auto version = client_->PushWeights(push);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 2u);

  auto down = client_->DownloadWeights("b32");
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_TRUE(down->has_bias);
  EXPECT_EQ(down->data, w_bytes);
  EXPECT_EQ(down->bias, b_bytes);
  EXPECT_EQ(down->weights_version, 2u);

  // b (fp32 on the server) in bf16: rounded as the wire's encoding rounds it.
  auto bf16 = client_->DownloadWeights("b32", v1::DTYPE_BF16);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->bias, Encode(b, v1::DTYPE_BF16));
  EXPECT_EQ(bf16->data.size(), static_cast<size_t>(kV * kD * 2));

  // A step, then db beside dW: equal to the bias pull of the *Into overload.
  HostBatch batch = MakeBatch(11, kD, kV, v1::DTYPE_FP32, 3);
  auto step = client_->Step(ToMicrobatch("b32", "bias", 1, batch));
  ASSERT_TRUE(step.ok()) << step.status();
  auto pulled = client_->PullGradient("b32");
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_TRUE(pulled->summary.bias());
  EXPECT_EQ(pulled->data.size(), w_bytes.size());
  ASSERT_EQ(pulled->bias.size(), b_bytes.size());
  client::Bytes dw(w_bytes.size()), db(b_bytes.size());
  auto into = client_->PullGradientInto("b32", v1::DTYPE_FP32, /*reset=*/true, dw, db);
  ASSERT_TRUE(into.ok()) << into.status();
  EXPECT_EQ(dw, pulled->data);
  EXPECT_EQ(db, pulled->bias);
  // Every token's softmax sums to one and its target takes one: db sums to about zero.
  double sum = 0;
  for (float x : Decode(db, v1::DTYPE_FP32)) sum += x;
  EXPECT_NEAR(sum, 0.0, 1e-4);
}

TEST_F(BiasTransfersTest, Bf16HeadKeepsItsBiasInFp32) {
  CreateBiasHead("b16", v1::DTYPE_BF16);
  const std::vector<float> w = RandomValues(kV * kD, 0.7, v1::DTYPE_BF16, 4);
  const std::vector<float> b = RandomValues(kV, 2.0, v1::DTYPE_FP32, 5);  // not bf16-exact
  const client::Bytes w_bytes = Encode(w, v1::DTYPE_FP32), b_bytes = Encode(b, v1::DTYPE_FP32);
  client::PushRequest push{.head = "b16", .dtype = v1::DTYPE_FP32, .data = w_bytes};
  push.bias = b_bytes;
  ASSERT_TRUE(client_->PushWeights(push).ok());
  auto down = client_->DownloadWeights("b16", v1::DTYPE_FP32);
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_EQ(down->data, w_bytes);
  EXPECT_EQ(down->bias, b_bytes);
}

TEST_F(BiasTransfersTest, RefusalsChangeNothingAndAHeadWithoutBiasSendsNone) {
  CreateBiasHead("plain", v1::DTYPE_FP32, /*bias=*/false);
  CreateBiasHead("biased", v1::DTYPE_FP32);
  const client::Bytes w_bytes =
      Encode(RandomValues(kV * kD, 0.7, v1::DTYPE_FP32, 6), v1::DTYPE_FP32);
  const client::Bytes b_bytes = Encode(RandomValues(kV, 1.0, v1::DTYPE_FP32, 7), v1::DTYPE_FP32);
  client::PushRequest push{.head = "plain", .dtype = v1::DTYPE_FP32, .data = w_bytes};
  push.bias = b_bytes;
  EXPECT_EQ(client_->PushWeights(push).status().code(), absl::StatusCode::kInvalidArgument);
  push.head = "biased";
  push.bias = std::span<const std::byte>(b_bytes).first(b_bytes.size() - 4);
  EXPECT_EQ(client_->PushWeights(push).status().code(), absl::StatusCode::kInvalidArgument);
  push.bias = {};
  EXPECT_EQ(client_->PushWeights(push).status().code(), absl::StatusCode::kInvalidArgument);
  auto biased = client_->DownloadWeights("biased");
  ASSERT_TRUE(biased.ok()) << biased.status();
  EXPECT_EQ(biased->weights_version, 1u);  // as created: zeros
  EXPECT_EQ(biased->bias, client::Bytes(b_bytes.size()));

  auto plain = client_->DownloadWeights("plain");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->has_bias);
  EXPECT_TRUE(plain->bias.empty());
  auto pulled = client_->PullGradient("plain");
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_FALSE(pulled->summary.bias());
  EXPECT_TRUE(pulled->bias.empty());
  // An *Into without a bias buffer for the head with one: refused, naming the bias, untouched.
  client::Bytes only_w(w_bytes.size(), std::byte{0x5a});
  auto refused = client_->DownloadWeightsInto("biased", v1::DTYPE_FP32, only_w);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("output bias"), std::string::npos) << refused.status();
  EXPECT_EQ(only_w, client::Bytes(w_bytes.size(), std::byte{0x5a}));
}

}  // namespace
}  // namespace losshead::testing
