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
  // And some token outputs (format 4), the correct count and a top-k (format 5) with them.
  v1::StepOptions& options = *mb.header.mutable_options();
  if (seq % 4 == 2) {
    options.add_token_outputs(v1::TOKEN_OUTPUT_LOGPROB);
    options.add_token_outputs(v1::TOKEN_OUTPUT_ARGMAX);
    options.set_return_correct_count(true);
    options.set_top_k(3);
  } else if (seq % 4 == 1) {
    options.add_token_outputs(v1::TOKEN_OUTPUT_ENTROPY);
    options.add_token_outputs(v1::TOKEN_OUTPUT_LSE);
  }
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
    if (GetParam() == v1::DTYPE_FP32) spec.set_matmul_precision(v1::MATMUL_PRECISION_HIGH);
    auto head = Head::Create(*backend_, spec, options);
    EXPECT_TRUE(head.ok()) << head.status();
    StepStats stats;
    for (uint64_t seq = 1; seq <= 4; ++seq) {
      EXPECT_TRUE((*head)->Step(Batch(N, D, V, GetParam(), "a", seq), &stats).ok());
    }
    EXPECT_TRUE((*head)->PullGradient(v1::DTYPE_FP32, true).ok());
    EXPECT_TRUE((*head)
                    ->PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_ADD,
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
  a.clear_memory();  // workspace: sized by the micro-batches each head has run
  b.clear_memory();
  a.clear_device_memory();
  b.clear_device_memory();
  EXPECT_EQ(a.SerializeAsString(), b.SerializeAsString());
  EXPECT_EQ(b.spec().matmul_precision(), GetParam() == v1::DTYPE_FP32
                                             ? v1::MATMUL_PRECISION_HIGH
                                             : v1::MATMUL_PRECISION_HIGHEST);
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
    EXPECT_EQ((*replay)->token_outputs, (*original)->token_outputs);
    EXPECT_EQ((*replay)->correct_count, (*original)->correct_count);
    EXPECT_EQ((*replay)->top_k_ids, (*original)->top_k_ids);
    EXPECT_EQ((*replay)->top_k_logprobs, (*original)->top_k_logprobs);
  }
  {
    // Sequence 6 asked for log p and the argmax, with the correct count: all remembered.
    StepStats stats;
    auto replay = (*restored)->Step(Batch(N, D, V, GetParam(), "a", 6), &stats);
    ASSERT_TRUE(replay.ok());
    EXPECT_EQ((*replay)->token_output(TokenOutput::kLogprob).size(), N * 4u);
    EXPECT_EQ((*replay)->token_output(TokenOutput::kArgmax).size(), N * 4u);
    EXPECT_TRUE((*replay)->token_output(TokenOutput::kEntropy).empty());
    EXPECT_TRUE((*replay)->correct_count.has_value());
    EXPECT_EQ((*replay)->top_k_ids.size(), N * 3 * 4u);
    EXPECT_EQ((*replay)->top_k_logprobs.size(), N * 3 * 4u);
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

void PutU64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }
void PutU32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }
void PutF64(std::string& out, double v) { out.append(reinterpret_cast<const char*>(&v), 8); }
void PutBytes(std::string& out, const std::string& s) {
  PutU64(out, s.size());
  out += s;
}

// A file as the format-2 writer made it (before fingerprints): a 3 x 2 fp32 head with a plain SGD,
// one remembered micro-batch of client "a" (sequence 1) and one remembered apply of client "o"
// (key 1), each record without the fingerprint that format 3 adds.
std::string FormatTwoFile(const std::string& dh, const v1::ApplyOptimizerResponse& applied) {
  v1::HeadSpec spec;
  spec.set_name("old");
  spec.set_vocab_size(3);
  spec.set_hidden_size(2);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
  std::string meta;
  PutBytes(meta, spec.SerializeAsString());
  for (uint64_t counter : {5, 2, 1, 5, 5, 2, 1}) PutU64(meta, counter);
  PutU64(meta, 1);  // clients
  PutBytes(meta, "a");
  meta.push_back(2);  // max applied only
  PutU64(meta, 0);
  PutU64(meta, 1);
  PutU64(meta, 1);  // results
  PutU64(meta, 1);  // sequence
  PutF64(meta, 1.5);
  PutU64(meta, 2);
  PutF64(meta, 0.75);
  PutU64(meta, 5);
  PutU32(meta, v1::DTYPE_FP32);
  PutBytes(meta, dh);
  PutBytes(meta, "");
  // The optimizer record: step 1, no momentum, master version 0, no master, no state buffers.
  PutU64(meta, 1);
  meta.push_back(0);
  PutU64(meta, 0);
  PutU64(meta, 0);
  PutU64(meta, 0);
  PutU64(meta, 1);  // apply clients
  PutBytes(meta, "o");
  PutU64(meta, 1);
  PutU64(meta, 1);
  PutU64(meta, 1);  // key
  PutBytes(meta, applied.SerializeAsString());
  const std::string weights(24, '\0');
  const std::string gradient(24, '\0');
  const uint32_t version = 2;
  std::string seed_fields;
  PutU32(seed_fields, version);
  for (uint64_t n : {meta.size(), weights.size(), gradient.size(), size_t{0}, size_t{0}}) {
    PutU64(seed_fields, n);
  }
  const uint64_t sum = Checksum(gradient, Checksum(weights, Checksum(meta, Checksum(seed_fields))));
  std::string file = "LHCKPT\r\n";
  PutU32(file, version);
  PutU32(file, 0);
  for (uint64_t n : {meta.size(), weights.size(), gradient.size(), sum, size_t{0}, size_t{0}}) {
    PutU64(file, n);
  }
  file.resize(64, '\0');
  return file + meta + weights + gradient;
}

// What a format-2 checkpoint remembers has no fingerprint: its keys replay whatever is resent (as
// before fingerprints existed), while keys used after the restore are checked, and the head's
// next checkpoint is format 3.
TEST(CheckpointFormatTwoTest, FilesStillRestoreAndTheirKeysReplayUnchecked) {
  const std::string dh(16, '\x11');
  v1::ApplyOptimizerResponse applied;
  applied.set_weights_version(5);
  applied.set_optimizer_step(1);
  auto decoded = DecodeCheckpoint(FormatTwoFile(dh, applied));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ASSERT_EQ(decoded->clients.size(), 1u);
  ASSERT_EQ(decoded->clients[0].results.size(), 1u);
  EXPECT_FALSE(decoded->clients[0].results[0].second->fingerprint.has_value());
  ASSERT_EQ(decoded->applies.size(), 1u);
  EXPECT_TRUE(decoded->applies[0].responses[0].fingerprint.empty());
  auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
  ASSERT_TRUE(backend.ok());
  auto head = Head::Restore(**backend, *decoded, HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();

  StepStats stats;
  auto replay = (*head)->Step(Batch(2, 2, 3, v1::DTYPE_FP32, "a", 1), &stats);
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(stats.replayed);
  EXPECT_EQ((*replay)->loss_sum, 1.5);
  EXPECT_EQ((*replay)->grad_hidden, dh);
  v1::ApplyOptimizerRequest apply;
  apply.set_client_id("o");
  apply.set_step_key(1);
  apply.mutable_params()->set_lr(0.5);
  apply.set_grad_divisor(1.0);
  auto apply_replay = (*head)->ApplyOptimizer(apply);
  ASSERT_TRUE(apply_replay.ok()) << apply_replay.status();
  EXPECT_TRUE(apply_replay->replayed());
  EXPECT_EQ(apply_replay->optimizer_step(), 1u);

  // A key used after the restore is fingerprinted, and the next file is format 3.
  ASSERT_TRUE((*head)->Step(Batch(2, 2, 3, v1::DTYPE_FP32, "a", 2), &stats).ok());
  ASSERT_TRUE((*head)->Step(Batch(2, 2, 3, v1::DTYPE_FP32, "a", 9), &stats).ok());
  MicroBatch other = Batch(2, 2, 3, v1::DTYPE_FP32, "a", 9);
  other.hidden = Batch(2, 2, 3, v1::DTYPE_FP32, "a", 10).hidden;
  EXPECT_EQ((*head)->Step(other, &stats).status().code(), absl::StatusCode::kAlreadyExists);
  auto snap = (*head)->Snapshot();
  ASSERT_TRUE(snap.ok());
  const std::string file = EncodeCheckpoint(*snap);
  uint32_t written_version;
  std::memcpy(&written_version, file.data() + 8, 4);
  EXPECT_EQ(written_version, kCheckpointFormatVersion);
  auto again = DecodeCheckpoint(file);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->clients[0].results.size(), 3u);
  EXPECT_FALSE(again->clients[0].results[0].second->fingerprint.has_value());
  EXPECT_TRUE(again->clients[0].results[1].second->fingerprint.has_value());
}

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
