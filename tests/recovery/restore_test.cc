// Checkpoint and GetClientProgress over gRPC with an in-process server: codes, deletion, restore.
#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "server/server.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {
namespace {

std::unique_ptr<server::Server> StartServer(const std::string& checkpoint_dir) {
  server::ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = "";
  options.backend = kernels::BackendKind::kCpu;
  options.worker_threads = 2;
  options.workspace_bytes = size_t{64} << 20;
  options.checkpoint_dir = checkpoint_dir;
  options.checkpoint_interval = absl::ZeroDuration();
  auto server = server::Server::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<client::Client> ClientOf(const server::Server& server) {
  auto c = client::Client::Connect(absl::StrCat("127.0.0.1:", server.port()));
  return c.ok() ? std::move(*c) : nullptr;
}

v1::HeadSpec Spec(const std::string& name) {
  v1::HeadSpec spec;
  spec.set_name(name);
  spec.set_vocab_size(32);
  spec.set_hidden_size(8);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  return spec;
}

class RestoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() /
            absl::StrCat("losshead-restore-", ::testing::UnitTest::GetInstance()->random_seed(),
                         "-", reinterpret_cast<uintptr_t>(this)))
               .string();
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_F(RestoreTest, CodesWithoutAndWithCheckpoints) {
  auto plain = StartServer("");
  auto c = ClientOf(*plain);
  EXPECT_EQ(c->Checkpoint().status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c->CreateHead(Spec("h")).ok());
  // Progress works without checkpoints: nothing is persisted, ever.
  auto p = c->GetClientProgress("h", "x");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->has_acknowledged_sequence());
  EXPECT_FALSE(p->has_persisted_sequence());
  EXPECT_EQ(c->GetClientProgress("nope", "x").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->GetClientProgress("h", "").status().code(), absl::StatusCode::kInvalidArgument);

  auto server = StartServer(dir_);
  auto c2 = ClientOf(*server);
  EXPECT_EQ(c2->Checkpoint("nope").status().code(), absl::StatusCode::kNotFound);
  auto empty = c2->Checkpoint();
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->heads_size(), 0);
}

TEST_F(RestoreTest, ProgressCheckpointRestoreAndDelete) {
  HostBatch batch = MakeBatch(4, 8, 32, v1::DTYPE_FP32, 11);
  std::vector<client::StepResult> first;
  {
    auto server = StartServer(dir_);
    auto c = ClientOf(*server);
    ASSERT_TRUE(c->CreateHead(Spec("h")).ok());
    ASSERT_TRUE(c->CreateHead(Spec("gone")).ok());
    for (uint64_t seq = 1; seq <= 3; ++seq) {
      auto r = c->Step(ToMicrobatch("h", "c1", seq, batch));
      ASSERT_TRUE(r.ok()) << r.status();
      first.push_back(*r);
    }
    auto written = c->Checkpoint("h");
    ASSERT_TRUE(written.ok()) << written.status();
    ASSERT_EQ(written->heads_size(), 1);
    EXPECT_EQ(written->heads(0).clients(0).persisted_sequence(), 3u);
    EXPECT_EQ(written->heads(0).microbatches_since_pull(), 3u);
    EXPECT_GT(written->heads(0).bytes(), 32u * 8 * 8);
    ASSERT_TRUE(c->Step(ToMicrobatch("h", "c1", 4, batch)).ok());
    auto p = c->GetClientProgress("h", "c1");
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->acknowledged_sequence(), 4u);
    EXPECT_EQ(p->persisted_sequence(), 3u);
    auto all = c->Checkpoint();
    ASSERT_TRUE(all.ok());
    EXPECT_EQ(all->heads_size(), 2);
    EXPECT_TRUE(std::filesystem::exists(dir_ + "/gone.lhck"));
    ASSERT_TRUE(c->DeleteHead("gone").ok());
    EXPECT_FALSE(std::filesystem::exists(dir_ + "/gone.lhck"));
    // Shutdown writes the final checkpoint: sequence 5 survives it.
    ASSERT_TRUE(c->Step(ToMicrobatch("h", "c1", 5, batch)).ok());
  }
  auto server = StartServer(dir_);
  auto c = ClientOf(*server);
  auto heads = c->ListHeads();
  ASSERT_TRUE(heads.ok());
  ASSERT_EQ(heads->size(), 1u);
  EXPECT_EQ((*heads)[0].microbatches_since_pull(), 5u);
  auto p = c->GetClientProgress("h", "c1");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->acknowledged_sequence(), 5u);
  EXPECT_EQ(p->persisted_sequence(), 5u);
  for (uint64_t seq = 1; seq <= 3; ++seq) {
    auto r = c->Step(ToMicrobatch("h", "c1", seq, batch));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->replayed);
    EXPECT_EQ(r->loss_sum, first[seq - 1].loss_sum);
    EXPECT_EQ(r->grad_hidden, first[seq - 1].grad_hidden);
  }
  auto info = c->GetHead("h");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), 5u);
}

}  // namespace
}  // namespace losshead::testing
