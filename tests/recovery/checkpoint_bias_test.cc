// A head with an output bias through the checkpoint format (6) and Head::Snapshot / Restore, and
// the older formats' files without one (5 and below), without gRPC.
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "server/durability/checkpoint.h"
#include "server/engine/head.h"

namespace losshead::server {
namespace {

constexpr int64_t kV = 11;
constexpr int64_t kD = 4;

std::string Fp32(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

MicroBatch Batch(uint64_t seq) {
  std::mt19937_64 rng(seq * 17 + 3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> h(6 * kD);
  for (float& x : h) x = normal(rng);
  std::vector<int32_t> y(6);
  for (int32_t& t : y) t = static_cast<int32_t>(rng() % kV);
  MicroBatch mb;
  mb.header.set_head("b");
  mb.header.set_client_id("c");
  mb.header.set_sequence(seq);
  mb.header.set_num_tokens(6);
  mb.header.set_hidden_dtype(v1::DTYPE_FP32);
  mb.header.set_target_dtype(v1::DTYPE_INT32);
  mb.hidden = Fp32(h);
  mb.targets.assign(reinterpret_cast<const char*>(y.data()), y.size() * sizeof(int32_t));
  return mb;
}

v1::HeadSpec BiasSpec() {
  v1::HeadSpec spec;
  spec.set_name("b");
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(v1::DTYPE_BF16);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  spec.set_bias(true);
  return spec;
}

std::unique_ptr<kernels::Backend> Cpu() {
  auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
  EXPECT_TRUE(backend.ok());
  return std::move(*backend);
}

absl::StatusOr<v1::ApplyOptimizerResponse> Apply(Head& head, uint64_t key) {
  v1::ApplyOptimizerRequest r;
  r.set_client_id("o");
  r.set_step_key(key);
  r.mutable_params()->set_lr(0.1);
  r.mutable_params()->set_beta1(0.9);
  r.mutable_params()->set_beta2(0.99);
  r.mutable_params()->set_eps(1e-8);
  r.mutable_params()->set_weight_decay(0.05);
  return head.ApplyOptimizer(r);
}

// b, the open window's db and b's moments survive the file: the restored head pulls the same
// window and, stepped the same way, reaches the same W and b bit for bit.
TEST(CheckpointBiasTest, RoundTripKeepsBiasWindowAndMoments) {
  auto backend = Cpu();
  auto head = Head::Create(*backend, BiasSpec(), HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();
  std::vector<float> b(kV);
  for (int64_t j = 0; j < kV; ++j) b[j] = 0.25f * static_cast<float>(j) - 1.0f;
  auto w = (*head)->DownloadWeights(v1::DTYPE_FP32);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(w->bias);
  std::string pushed = w->data.substr(0, kV * kD * sizeof(float)) + Fp32(b);
  ASSERT_TRUE((*head)->PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, pushed, {}).ok());
  StepStats stats;
  ASSERT_TRUE((*head)->Step(Batch(1), &stats).ok());
  ASSERT_TRUE(Apply(**head, 1).ok());
  ASSERT_TRUE((*head)->Step(Batch(2), &stats).ok());  // an open window

  auto snap = (*head)->Snapshot();
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_EQ(snap->bias.size(), kV * sizeof(float));
  ASSERT_EQ(snap->bias_optimizer_state.size(), 2u);
  const std::string file = EncodeCheckpoint(*snap);
  uint32_t version;
  std::memcpy(&version, file.data() + 8, 4);
  EXPECT_EQ(version, kCheckpointFormatVersion);
  auto decoded = DecodeCheckpoint(file);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->bias, snap->bias);
  EXPECT_EQ(decoded->grad_bias, snap->grad_bias);
  EXPECT_EQ(decoded->bias_optimizer_state, snap->bias_optimizer_state);
  auto restored = Head::Restore(*backend, *decoded, HeadOptions{});
  ASSERT_TRUE(restored.ok()) << restored.status();

  auto window = (*head)->PullGradient(v1::DTYPE_FP32, false);
  auto window_again = (*restored)->PullGradient(v1::DTYPE_FP32, false);
  ASSERT_TRUE(window.ok() && window_again.ok());
  EXPECT_TRUE(window_again->summary.bias());
  EXPECT_EQ(window->data, window_again->data);  // dW then db
  for (Head* h : {head->get(), restored->get()}) {
    ASSERT_TRUE(Apply(*h, 2).ok());
    ASSERT_TRUE(h->Step(Batch(3), &stats).ok());
    ASSERT_TRUE(Apply(*h, 3).ok());
  }
  auto a = (*head)->DownloadWeights(v1::DTYPE_FP32);
  auto c = (*restored)->DownloadWeights(v1::DTYPE_FP32);
  ASSERT_TRUE(a.ok() && c.ok());
  EXPECT_EQ(a->data, c->data);
  EXPECT_NE(a->data.substr(kV * kD * sizeof(float)), Fp32(b));  // b was stepped
}

// A bias record that does not fit the spec is refused, by the file (DATA_LOSS) or the restore.
TEST(CheckpointBiasTest, MismatchedBiasIsDataLoss) {
  auto backend = Cpu();
  auto head = Head::Create(*backend, BiasSpec(), HeadOptions{});
  ASSERT_TRUE(head.ok());
  auto snap = (*head)->Snapshot();
  ASSERT_TRUE(snap.ok());
  HeadCheckpointData short_bias = *snap;
  short_bias.bias.resize(short_bias.bias.size() - 4);
  EXPECT_EQ(Head::Restore(*backend, short_bias, HeadOptions{}).status().code(),
            absl::StatusCode::kDataLoss);
  HeadCheckpointData no_state = *snap;
  no_state.bias_optimizer_state.clear();
  EXPECT_EQ(Head::Restore(*backend, no_state, HeadOptions{}).status().code(),
            absl::StatusCode::kDataLoss);
  // The spec says no bias but the record has one: the file itself is refused.
  HeadCheckpointData unbiased = *snap;
  unbiased.spec.set_bias(false);
  std::string file = EncodeCheckpoint(unbiased);  // writes no bias record for it
  auto decoded = DecodeCheckpoint(file);
  ASSERT_TRUE(decoded.ok());
  EXPECT_TRUE(decoded->bias.empty());
  EXPECT_EQ(Head::Restore(*backend, unbiased, HeadOptions{}).status().code(),
            absl::StatusCode::kDataLoss);
}

uint64_t U64At(const std::string& file, size_t at) {
  uint64_t v;
  std::memcpy(&v, file.data() + at, 8);
  return v;
}

void PutU64At(std::string& file, size_t at, uint64_t v) { std::memcpy(file.data() + at, &v, 8); }

// A format-5 file (what the writer made before the bias record: the same file without meta's
// last two bytes, format 6's bias record and format 7's rows record) of a head without a bias
// still restores, as one without a bias.
TEST(CheckpointBiasTest, FormatFiveFilesStillRestore) {
  auto backend = Cpu();
  v1::HeadSpec spec = BiasSpec();
  spec.set_bias(false);
  spec.clear_optimizer();
  auto head = Head::Create(*backend, spec, HeadOptions{});
  ASSERT_TRUE(head.ok());
  StepStats stats;
  ASSERT_TRUE((*head)->Step(Batch(1), &stats).ok());
  auto snap = (*head)->Snapshot();
  ASSERT_TRUE(snap.ok());
  const std::string six = EncodeCheckpoint(*snap);
  // Header: magic, version u32, reserved u32, then meta, weights, gradient bytes, checksum,
  // optimizer bytes, piece bytes (u64 each); the sections follow its 64 bytes.
  const uint64_t meta_bytes = U64At(six, 16);
  const uint64_t weights_bytes = U64At(six, 24);
  const uint64_t gradient_bytes = U64At(six, 32);
  ASSERT_EQ(U64At(six, 48), 0u);  // no optimizer section
  ASSERT_EQ(kCheckpointFormatVersion, 7u);  // format 7: the meta ends in two one-byte records
  ASSERT_EQ(six[64 + meta_bytes - 2], '\0');  // format 6's bias record: no bias
  ASSERT_EQ(six[64 + meta_bytes - 1], '\0');  // format 7's rows record: all rows
  const uint64_t five_meta = meta_bytes - 2;
  std::string five = six.substr(0, 64) + six.substr(64, five_meta) + six.substr(64 + meta_bytes);
  const uint32_t version = 5;
  std::memcpy(five.data() + 8, &version, 4);
  PutU64At(five, 16, five_meta);
  std::string fields(reinterpret_cast<const char*>(&version), 4);
  for (uint64_t n : {five_meta, weights_bytes, gradient_bytes, uint64_t{0}, uint64_t{0}}) {
    fields.append(reinterpret_cast<const char*>(&n), 8);
  }
  const std::string meta = five.substr(64, five_meta);
  const std::string weights = five.substr(64 + five_meta, weights_bytes);
  const std::string gradient = five.substr(64 + five_meta + weights_bytes);
  PutU64At(five, 40, Checksum(gradient, Checksum(weights, Checksum(meta, Checksum(fields)))));
  auto decoded = DecodeCheckpoint(five);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_FALSE(decoded->spec.bias());
  auto restored = Head::Restore(*backend, *decoded, HeadOptions{});
  ASSERT_TRUE(restored.ok()) << restored.status();
  auto a = (*head)->PullGradient(v1::DTYPE_FP32, false);
  auto b = (*restored)->PullGradient(v1::DTYPE_FP32, false);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->data, b->data);
  EXPECT_FALSE(b->summary.bias());
}

}  // namespace
}  // namespace losshead::server
