// A tied head's two calls end to end through the C++ client and a real server: EmbeddingRows
// streams W's rows (several chunks under a small message limit) with their version, and
// EMBEDDING_GRAD micro-batches on the Step stream land in the pulled window as a float64
// scatter-add, replay under their key, and are refused with their code (nothing counted) for bad
// ids, shapes, non-finite rows or a loss's options.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kD = 24, kV = 53;

// A small message limit: the rows of 300 ids need several chunks.
class EmbeddingRowsServiceTest : public SharedServerTest<16 << 10> {};

std::span<const std::byte> AsBytes(const std::vector<float>& v) {
  return std::as_bytes(std::span<const float>(v));
}

std::vector<float> ToFloats(const client::Bytes& bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

TEST_F(EmbeddingRowsServiceTest, RowsAreWsRowsInChunks) {
  auto head = CreateKnownHead(*client_, "rows", kV, kD, v1::DTYPE_FP32, 3);
  ASSERT_TRUE(head.ok()) << head.status();
  std::mt19937_64 rng(4);
  std::vector<int64_t> ids(300);
  for (int64_t& id : ids) id = static_cast<int64_t>(rng() % kV);
  auto rows = client_->EmbeddingRows("rows", ids);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->num_rows, 300);
  EXPECT_EQ(rows->hidden_size, kD);
  EXPECT_EQ(rows->dtype, v1::DTYPE_FP32);
  EXPECT_EQ(rows->weights_version, head->version);
  const std::vector<float> got = ToFloats(rows->data);
  ASSERT_EQ(got.size(), ids.size() * kD);
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int64_t j = 0; j < kD; ++j) {
      ASSERT_EQ(got[i * kD + j], head->weight[ids[i] * kD + j]) << i;
    }
  }
  const int64_t outside[] = {kV};
  EXPECT_EQ(client_->EmbeddingRows("rows", outside).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->EmbeddingRows("nobody", ids).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(
      client_->EmbeddingRows("rows", ids, v1::DTYPE_UNSPECIFIED, head->version + 1).status().code(),
      absl::StatusCode::kFailedPrecondition);
}

TEST_F(EmbeddingRowsServiceTest, GradRowsLandReplayAndBadOnesChangeNothing) {
  auto head = CreateKnownHead(*client_, "grad", kV, kD, v1::DTYPE_FP32, 5);
  ASSERT_TRUE(head.ok()) << head.status();
  const std::vector<int64_t> ids = {7, 2, 7, 52, 0, 7};
  std::vector<float> de(ids.size() * kD);
  std::mt19937_64 rng(6);
  std::normal_distribution<float> normal;
  for (float& x : de) x = normal(rng);
  auto added = client_->EmbeddingGrad("grad", "emb", 1, ids, v1::DTYPE_FP32, AsBytes(de));
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_EQ(added->token_count, 0);
  EXPECT_FALSE(added->replayed);
  auto again = client_->EmbeddingGrad("grad", "emb", 1, ids, v1::DTYPE_FP32, AsBytes(de));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->replayed);
  std::vector<float> other = de;
  other[0] += 1;
  EXPECT_EQ(
      client_->EmbeddingGrad("grad", "emb", 1, ids, v1::DTYPE_FP32, AsBytes(other)).status().code(),
      absl::StatusCode::kAlreadyExists);

  std::vector<double> want(kV * kD, 0.0);
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int64_t j = 0; j < kD; ++j) want[ids[i] * kD + j] += de[i * kD + j];
  }
  auto pulled = client_->PullGradient("grad");
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->summary.microbatch_count(), 1u);
  EXPECT_EQ(pulled->summary.token_count(), 0u);
  const std::vector<float> got = ToFloats(pulled->data);
  for (size_t k = 0; k < want.size(); ++k) {
    ASSERT_NEAR(got[k], want[k], 1e-6 * std::max(1.0, std::abs(want[k]))) << k;
  }

  std::vector<float> nan = de;
  nan[5] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<int64_t> outside = {1, kV, 2, 3, 4, 5};
  EXPECT_EQ(
      client_->EmbeddingGrad("grad", "emb", 2, ids, v1::DTYPE_FP32, AsBytes(nan)).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->EmbeddingGrad("grad", "emb", 2, outside, v1::DTYPE_FP32, AsBytes(de))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<float> short_de(de.begin(), de.end() - 1);
  EXPECT_EQ(client_->EmbeddingGrad("grad", "emb", 2, ids, v1::DTYPE_FP32, AsBytes(short_de))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  client::Microbatch with_loss_option;
  with_loss_option.kind = v1::STEP_KIND_EMBEDDING_GRAD;
  with_loss_option.head = "grad";
  with_loss_option.client_id = "emb";
  with_loss_option.sequence = 2;
  with_loss_option.num_tokens = static_cast<int64_t>(ids.size());
  with_loss_option.hidden_dtype = v1::DTYPE_FP32;
  with_loss_option.hidden = AsBytes(de);
  with_loss_option.target_dtype = v1::DTYPE_INT64;
  with_loss_option.targets = std::as_bytes(std::span<const int64_t>(ids));
  with_loss_option.options.set_return_per_token_loss(true);
  EXPECT_EQ(client_->Step(with_loss_option).status().code(), absl::StatusCode::kInvalidArgument);
  // A top-k is a loss's output: refused by name, not ignored.
  client::Microbatch with_top_k = with_loss_option;
  with_top_k.options.Clear();
  with_top_k.options.set_top_k(2);
  auto top_k = client_->Step(with_top_k);
  EXPECT_EQ(top_k.status().code(), absl::StatusCode::kInvalidArgument) << top_k.status();
  EXPECT_NE(top_k.status().message().find("options.top_k is a loss's option"), std::string::npos)
      << top_k.status();
  auto after = client_->PullGradient("grad");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->summary.microbatch_count(), 1u);
  EXPECT_EQ(after->data, pulled->data);
  // The refusals left the key free.
  EXPECT_TRUE(client_->EmbeddingGrad("grad", "emb", 2, ids, v1::DTYPE_FP32, AsBytes(de)).ok());
}

}  // namespace
}  // namespace losshead::testing
