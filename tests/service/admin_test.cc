// Head management, stats and health through the client, on a real server.
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

TEST(AdminTest, CreateGetListSetOptionsDeleteAndStats) {
  auto server = TestServer::Start(size_t{1} << 20);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->NewClient();
  ASSERT_NE(client, nullptr);

  auto health = client->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, client::ServingStatus::kServing);

  v1::HeadSpec spec;
  spec.set_name("admin.head-1");
  spec.set_vocab_size(33);
  spec.set_hidden_size(7);
  spec.set_weight_dtype(v1::DTYPE_BF16);
  spec.mutable_init()->mutable_normal()->set_std(0.02f);
  spec.mutable_init()->mutable_normal()->set_seed(9);
  auto created = client->CreateHead(spec);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->spec().name(), "admin.head-1");
  EXPECT_EQ(created->spec().vocab_size(), 33);
  EXPECT_EQ(created->weights_version(), 1u);
  EXPECT_EQ(created->memory().weights_bytes(), 33u * 7u * 2u);
  EXPECT_EQ(created->memory().gradient_bytes(), 33u * 7u * 4u);
  EXPECT_EQ(created->device().substr(0, 3), "cpu");

  // Normal init is what the spec says: std 0.02 drawn from the seed; check its scale only.
  auto weights = client->DownloadWeights("admin.head-1");
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(weights->dtype, v1::DTYPE_BF16);
  double sum_sq = 0;
  for (float x : Decode(weights->data, v1::DTYPE_BF16)) sum_sq += double{x} * x;
  const double std = std::sqrt(sum_sq / (33 * 7));
  EXPECT_GT(std, 0.015);
  EXPECT_LT(std, 0.025);

  spec.set_name("admin-zero");
  spec.clear_init();
  ASSERT_TRUE(client->CreateHead(spec).ok());
  auto zero = client->DownloadWeights("admin-zero", v1::DTYPE_FP32);
  ASSERT_TRUE(zero.ok());
  for (float x : Decode(zero->data, v1::DTYPE_FP32)) ASSERT_EQ(x, 0.0f);

  auto listed = client->ListHeads();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 2u);

  v1::LossOptions defaults;
  defaults.set_reduction(v1::REDUCTION_SUM);
  defaults.set_z_loss(1e-4f);
  auto updated = client->SetLossOptions("admin-zero", defaults);
  ASSERT_TRUE(updated.ok()) << updated.status();
  auto got = client->GetHead("admin-zero");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->spec().default_options().reduction(), v1::REDUCTION_SUM);
  EXPECT_FLOAT_EQ(got->spec().default_options().z_loss(), 1e-4f);

  auto stats = client->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->device().backend(), "cpu");
  EXPECT_EQ(stats->max_message_bytes(), size_t{1} << 20);
  EXPECT_EQ(stats->heads_size(), 2);
  EXPECT_EQ(stats->inflight_microbatches(), 0u);
  EXPECT_FALSE(stats->version().empty());

  EXPECT_TRUE(client->DeleteHead("admin-zero").ok());
  EXPECT_EQ(client->GetHead("admin-zero").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client->DeleteHead("admin-zero").code(), absl::StatusCode::kNotFound);
  listed = client->ListHeads();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 1u);
}

}  // namespace
}  // namespace losshead::testing
