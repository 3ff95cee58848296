// The checkpoint file format and Head::Snapshot / Head::Restore, without gRPC.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/durability/checkpoint.h"
#include "server/engine/head.h"

namespace losshead::server {
namespace {

kernels::DType KernelDType(v1::DType d) {
  return d == v1::DTYPE_BF16   ? kernels::DType::kBF16
         : d == v1::DTYPE_FP16 ? kernels::DType::kFP16
                               : kernels::DType::kFP32;
}

std::string Floats(const std::vector<float>& v, v1::DType dtype) {
  std::string out(v.size() * kernels::DTypeSize(KernelDType(dtype)), '\0');
  kernels::FromFloat(KernelDType(dtype), v.data(), out.data(), v.size());
  return out;
}

MicroBatch Batch(int64_t n, int64_t d, int64_t v, v1::DType dtype, const std::string& client,
                 uint64_t seq) {
  std::mt19937_64 rng(seq * 31 + 7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> h(n * d);
  for (float& x : h) x = normal(rng);
  std::vector<int32_t> y(n);
  for (int32_t& t : y) t = static_cast<int32_t>(rng() % v);
  MicroBatch mb;
  mb.header.set_head("h");
  mb.header.set_client_id(client);
  mb.header.set_sequence(seq);
  mb.header.set_num_tokens(n);
  mb.header.set_hidden_dtype(dtype);
  mb.header.set_target_dtype(v1::DTYPE_INT32);
  // Some results convert dH to another dtype, some keep per-token losses: all must round-trip.
  if (seq % 2 == 0) mb.header.mutable_options()->set_grad_hidden_dtype(v1::DTYPE_FP32);
  if (seq % 3 == 0) mb.header.mutable_options()->set_return_per_token_loss(true);
  mb.hidden = Floats(h, dtype);
  mb.targets.assign(reinterpret_cast<const char*>(y.data()), y.size() * 4);
  return mb;
}

class CheckpointFormatTest : public ::testing::TestWithParam<v1::DType> {
 protected:
  void SetUp() override {
    auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(*backend);
  }

  // A head with W pushed, dW from several clients' micro-batches, a pull, and defaults changed.
  std::shared_ptr<Head> Trained(const HeadOptions& options = {}) {
    v1::HeadSpec spec;
    spec.set_name("h");
    spec.set_vocab_size(V);
    spec.set_hidden_size(D);
    spec.set_weight_dtype(GetParam());
    spec.mutable_init()->mutable_normal()->set_std(0.5f);
    spec.mutable_init()->mutable_normal()->set_seed(3);
    auto head = Head::Create(*backend_, spec, options);
    EXPECT_TRUE(head.ok()) << head.status();
    StepStats stats;
    for (uint64_t seq = 1; seq <= 4; ++seq) {
      EXPECT_TRUE((*head)->Step(Batch(N, D, V, GetParam(), "a", seq), &stats).ok());
    }
    EXPECT_TRUE((*head)->PullGradient(v1::DTYPE_FP32, true).ok());
    EXPECT_TRUE((*head)->PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_ADD,
                                     Floats(std::vector<float>(V * D, 0.25f), v1::DTYPE_FP32),
                                     std::nullopt)
                    .ok());
    for (uint64_t seq = 5; seq <= 7; ++seq) {
      EXPECT_TRUE((*head)->Step(Batch(N, D, V, GetParam(), "a", seq), &stats).ok());
    }
    EXPECT_TRUE((*head)->Step(Batch(N, D, V, GetParam(), "b", 100), &stats).ok());
    v1::LossOptions defaults;
    defaults.set_label_smoothing(0.125f);
    EXPECT_TRUE((*head)->SetDefaultOptions(defaults).ok());
    return *head;
  }

  static constexpr int64_t V = 24, D = 12, N = 5;
  std::unique_ptr<kernels::Backend> backend_;
};

TEST_P(CheckpointFormatTest, RestoreReproducesTheHeadExactly) {
  std::shared_ptr<Head> head = Trained();
  auto snap = head->Snapshot();
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->weights_version, 2u);
  EXPECT_EQ(snap->microbatches_since_pull, 4u);
  ASSERT_EQ(snap->clients.size(), 2u);
  EXPECT_EQ(snap->clients[0].results.size(), 7u);
  const std::string file = EncodeCheckpoint(*snap);

  auto decoded = DecodeCheckpoint(file);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  auto restored = Head::Restore(*backend_, *decoded, HeadOptions{});
  ASSERT_TRUE(restored.ok()) << restored.status();
  auto again = (*restored)->Snapshot();
  ASSERT_TRUE(again.ok());
  // Byte-identical files: W, dW, counters, defaults and every remembered result survived.
  EXPECT_EQ(EncodeCheckpoint(*again), file);

  v1::HeadInfo a = head->Info(), b = (*restored)->Info();
  a.clear_memory();
  b.clear_memory();
  EXPECT_EQ(a.SerializeAsString(), b.SerializeAsString());
  EXPECT_EQ((*restored)->Progress("a").persisted_sequence(), 7u);
  EXPECT_EQ((*restored)->Progress("a").acknowledged_sequence(), 7u);
  EXPECT_FALSE((*restored)->Progress("nobody").has_acknowledged_sequence());

  // A replay on the restored head: the original bytes, flagged, nothing counted.
  for (uint64_t seq : {3u, 6u}) {
    StepStats s1, s2;
    auto original = head->Step(Batch(N, D, V, GetParam(), "a", seq), &s1);
    auto replay = (*restored)->Step(Batch(N, D, V, GetParam(), "a", seq), &s2);
    ASSERT_TRUE(original.ok() && replay.ok());
    EXPECT_TRUE(s1.replayed && s2.replayed);
    EXPECT_EQ((*replay)->loss_sum, (*original)->loss_sum);
    EXPECT_EQ((*replay)->grad_hidden, (*original)->grad_hidden);
    EXPECT_EQ((*replay)->per_token_loss, (*original)->per_token_loss);
    EXPECT_EQ((*replay)->grad_hidden_dtype, (*original)->grad_hidden_dtype);
  }
  // The next new micro-batch lands on the same dW on both heads.
  StepStats s;
  ASSERT_TRUE(head->Step(Batch(N, D, V, GetParam(), "a", 8), &s).ok());
  ASSERT_TRUE((*restored)->Step(Batch(N, D, V, GetParam(), "a", 8), &s).ok());
  auto g1 = head->PullGradient(v1::DTYPE_FP32, false);
  auto g2 = (*restored)->PullGradient(v1::DTYPE_FP32, false);
  ASSERT_TRUE(g1.ok() && g2.ok());
  EXPECT_EQ(g1->data, g2->data);
  EXPECT_EQ(g1->summary.SerializeAsString(), g2->summary.SerializeAsString());
  EXPECT_EQ((*restored)->Progress("a").acknowledged_sequence(), 8u);
  EXPECT_EQ((*restored)->Progress("a").persisted_sequence(), 7u);
}

TEST_P(CheckpointFormatTest, SmallerWindowAfterRestoreKeepsTheFloor) {
  auto snap = Trained()->Snapshot();
  ASSERT_TRUE(snap.ok());
  auto restored = Head::Restore(*backend_, *snap, HeadOptions{.idempotency_window = 2});
  ASSERT_TRUE(restored.ok());
  StepStats s;
  // 1..5 left the smaller window: the server cannot tell whether they were counted.
  auto old = (*restored)->Step(Batch(N, D, V, GetParam(), "a", 5), &s);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition) << old.status();
  EXPECT_TRUE((*restored)->Step(Batch(N, D, V, GetParam(), "a", 7), &s).ok());
  EXPECT_TRUE(s.replayed);
}

TEST_P(CheckpointFormatTest, EveryFlippedByteAndEveryTruncationIsRefused) {
  auto snap = Trained()->Snapshot();
  ASSERT_TRUE(snap.ok());
  const std::string file = EncodeCheckpoint(*snap);
  ASSERT_TRUE(DecodeCheckpoint(file).ok());
  for (size_t i = 0; i < file.size(); ++i) {
    std::string bad = file;
    bad[i] ^= static_cast<char>(1 << (i % 8));
    const absl::Status s = DecodeCheckpoint(bad).status();
    ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss) << "byte " << i << " of " << file.size();
  }
  for (size_t len = 0; len < file.size(); len += 7) {
    ASSERT_EQ(DecodeCheckpoint(file.substr(0, len)).status().code(), absl::StatusCode::kDataLoss)
        << len;
  }
  ASSERT_EQ(DecodeCheckpoint(file + "x").status().code(), absl::StatusCode::kDataLoss);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CheckpointFormatTest,
                         ::testing::Values(v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16),
                         [](const auto& info) { return v1::DType_Name(info.param); });

TEST(CheckpointFileTest, AtomicWriteAndReadBack) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / absl::StrCat("lhck-", getpid())).string();
  std::filesystem::create_directories(dir);
  auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
  ASSERT_TRUE(backend.ok());
  // A 8192 x 1024 bf16 head: W 16 MiB + dW 32 MiB.
  v1::HeadSpec spec;
  spec.set_name("big");
  spec.set_vocab_size(8192);
  spec.set_hidden_size(1024);
  spec.set_weight_dtype(v1::DTYPE_BF16);
  auto head = Head::Create(**backend, spec, HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();
  const absl::Time start = absl::Now();
  auto snap = (*head)->Snapshot();
  ASSERT_TRUE(snap.ok());
  const absl::Time snapped = absl::Now();
  const std::string path = dir + "/big.lhck";
  auto bytes = WriteCheckpointFile(path, *snap);
  const absl::Time written = absl::Now();
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, std::filesystem::file_size(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  auto read = ReadCheckpointFile(path);
  const absl::Time read_done = absl::Now();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->weights, snap->weights);
  EXPECT_EQ(read->gradient, snap->gradient);
  std::printf(
      "[figures] checkpoint of a 8192 x 1024 bf16 head (%.1f MiB): snapshot %.3f s, write + fsync "
      "+ rename %.3f s, read + verify %.3f s\n",
      static_cast<double>(*bytes) / (1 << 20), absl::ToDoubleSeconds(snapped - start),
      absl::ToDoubleSeconds(written - snapped), absl::ToDoubleSeconds(read_done - written));
  auto missing = ReadCheckpointFile(dir + "/none.lhck");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("none.lhck"), absl::string_view::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace losshead::server
