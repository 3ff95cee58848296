// The server-side optimizer in checkpoints: master weights, state, step count and remembered
// applies survive a round trip exactly, and a format-1 file (no optimizer) still restores.
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/durability/checkpoint.h"
#include "server/engine/head.h"

namespace losshead::server {
namespace {

constexpr int64_t kV = 19, kD = 6, kN = 10;

MicroBatch Batch(uint64_t seq) {
  std::mt19937_64 rng(seq);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> h(kN * kD);
  for (float& x : h) x = normal(rng);
  std::vector<int32_t> y(kN);
  for (int32_t& t : y) t = static_cast<int32_t>(rng() % kV);
  MicroBatch mb;
  mb.header.set_head("h");
  mb.header.set_client_id("c");
  mb.header.set_sequence(seq);
  mb.header.set_num_tokens(kN);
  mb.header.set_hidden_dtype(v1::DTYPE_FP32);
  mb.header.set_target_dtype(v1::DTYPE_INT32);
  mb.hidden.assign(reinterpret_cast<const char*>(h.data()), h.size() * 4);
  mb.targets.assign(reinterpret_cast<const char*>(y.data()), y.size() * 4);
  return mb;
}

v1::ApplyOptimizerRequest Apply(uint64_t key, v1::OptimizerKind kind) {
  v1::ApplyOptimizerRequest r;
  r.set_client_id("trainer");
  r.set_step_key(key);
  v1::OptimizerHyperParams& p = *r.mutable_params();
  p.set_lr(0.05);
  p.set_weight_decay(0.01);
  if (kind == v1::OPTIMIZER_SGD) {
    p.set_momentum(0.9);
    p.set_nesterov(true);
  } else {
    p.set_beta1(0.9);
    p.set_beta2(0.99);
    p.set_eps(1e-8);
  }
  r.set_max_norm(0.5);
  r.set_trunk_grad_sq_norm(0.1);
  return r;
}

struct Param {
  v1::DType dtype;
  v1::OptimizerKind kind;
};

class OptimizerCheckpointTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(backend.ok());
    backend_ = std::move(*backend);
  }
  std::shared_ptr<Head> Trained() {
    v1::HeadSpec spec;
    spec.set_name("h");
    spec.set_vocab_size(kV);
    spec.set_hidden_size(kD);
    spec.set_weight_dtype(GetParam().dtype);
    spec.mutable_init()->mutable_normal()->set_std(0.4f);
    spec.mutable_optimizer()->set_kind(GetParam().kind);
    spec.mutable_optimizer()->set_momentum_buffer(GetParam().kind == v1::OPTIMIZER_SGD);
    auto head = Head::Create(*backend_, spec, HeadOptions{});
    EXPECT_TRUE(head.ok()) << head.status();
    StepStats stats;
    for (uint64_t seq = 1; seq <= 6; ++seq) {
      EXPECT_TRUE((*head)->Step(Batch(seq), &stats).ok());
      if (seq % 2 == 0) EXPECT_TRUE((*head)->ApplyOptimizer(Apply(seq / 2, GetParam().kind)).ok());
    }
    EXPECT_TRUE((*head)->Step(Batch(7), &stats).ok());  // a window in progress
    return *head;
  }
  std::unique_ptr<kernels::Backend> backend_;
};

TEST_P(OptimizerCheckpointTest, RoundTripIsExactAndTrainingGoesOnIdentically) {
  std::shared_ptr<Head> head = Trained();
  auto snap = head->Snapshot();
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->optimizer_step, 3u);
  EXPECT_EQ(snap->optimizer_state.size(), GetParam().kind == v1::OPTIMIZER_ADAMW ? 2u : 1u);
  EXPECT_EQ(snap->master.empty(), GetParam().dtype == v1::DTYPE_FP32);
  ASSERT_EQ(snap->applies.size(), 1u);
  const std::string file = EncodeCheckpoint(*snap);
  auto decoded = DecodeCheckpoint(file);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  auto restored = Head::Restore(*backend_, *decoded, HeadOptions{});
  ASSERT_TRUE(restored.ok()) << restored.status();
  auto again = (*restored)->Snapshot();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(EncodeCheckpoint(*again), file);
  EXPECT_EQ((*restored)->Info().optimizer_step(), 3u);
  EXPECT_EQ((*restored)->Info().memory().master_weights_bytes(),
            head->Info().memory().master_weights_bytes());
  EXPECT_EQ((*restored)->Info().memory().optimizer_state_bytes(),
            head->Info().memory().optimizer_state_bytes());

  // The applies are remembered across the restart; the next one steps both heads the same.
  for (uint64_t key : {2, 3}) {
    auto replay = (*restored)->ApplyOptimizer(Apply(key, GetParam().kind));
    ASSERT_TRUE(replay.ok()) << replay.status();
    EXPECT_TRUE(replay->replayed());
    EXPECT_EQ(replay->optimizer_step(), key);
  }
  StepStats stats;
  for (Head* h : {head.get(), restored->get()}) {
    ASSERT_TRUE(h->Step(Batch(8), &stats).ok());
    auto applied = h->ApplyOptimizer(Apply(4, GetParam().kind));
    ASSERT_TRUE(applied.ok()) << applied.status();
    EXPECT_EQ(applied->optimizer_step(), 4u);
  }
  auto a = head->Snapshot();
  auto b = (*restored)->Snapshot();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->weights, b->weights);
  EXPECT_EQ(a->master, b->master);
  EXPECT_EQ(a->optimizer_state, b->optimizer_state);
}

TEST_P(OptimizerCheckpointTest, EveryFlippedByteIsRefused) {
  auto snap = Trained()->Snapshot();
  ASSERT_TRUE(snap.ok());
  const std::string file = EncodeCheckpoint(*snap);
  for (size_t i = 0; i < file.size(); ++i) {
    std::string bad = file;
    bad[i] ^= static_cast<char>(1 << (i % 8));
    ASSERT_EQ(DecodeCheckpoint(bad).status().code(), absl::StatusCode::kDataLoss) << i;
  }
  ASSERT_EQ(DecodeCheckpoint(file.substr(0, file.size() - 1)).status().code(),
            absl::StatusCode::kDataLoss);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, OptimizerCheckpointTest,
                         ::testing::Values(Param{v1::DTYPE_BF16, v1::OPTIMIZER_ADAMW},
                                           Param{v1::DTYPE_FP32, v1::OPTIMIZER_ADAMW},
                                           Param{v1::DTYPE_FP16, v1::OPTIMIZER_SGD},
                                           Param{v1::DTYPE_FP32, v1::OPTIMIZER_LION}),
                         [](const auto& info) {
                           return v1::DType_Name(info.param.dtype) + "_" +
                                  v1::OptimizerKind_Name(info.param.kind);
                         });

void Put64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }

// A file as the format-1 writer made it: 64-byte header, meta (spec, 7 counters, no clients),
// W, dW; its checksum seeded by the version and the three lengths.
TEST(OptimizerCheckpointFormatTest, FormatOneFilesStillRestore) {
  v1::HeadSpec spec;
  spec.set_name("old");
  spec.set_vocab_size(3);
  spec.set_hidden_size(2);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  std::string meta;
  const std::string spec_bytes = spec.SerializeAsString();
  Put64(meta, spec_bytes.size());
  meta += spec_bytes;
  for (uint64_t counter : {5, 0, 0, 0, 0, 40, 4}) Put64(meta, counter);
  Put64(meta, 0);  // clients
  const std::vector<float> w = {1, 2, 3, 4, 5, 6};
  const std::string weights(reinterpret_cast<const char*>(w.data()), 24);
  const std::string gradient(24, '\0');
  std::string seed_fields;
  const uint32_t version = 1;
  seed_fields.append(reinterpret_cast<const char*>(&version), 4);
  for (uint64_t n : {meta.size(), weights.size(), gradient.size()}) Put64(seed_fields, n);
  const uint64_t sum = Checksum(gradient, Checksum(weights, Checksum(meta, Checksum(seed_fields))));
  std::string file = "LHCKPT\r\n";
  file.append(reinterpret_cast<const char*>(&version), 4);
  file.append(4, '\0');
  for (uint64_t n : {meta.size(), weights.size(), gradient.size(), sum}) Put64(file, n);
  file.append(16, '\0');
  file += meta + weights + gradient;

  auto decoded = DecodeCheckpoint(file);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->weights_version, 5u);
  EXPECT_TRUE(decoded->master.empty());
  auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
  ASSERT_TRUE(backend.ok());
  auto head = Head::Restore(**backend, *decoded, HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->Info().spec().optimizer().kind(), v1::OPTIMIZER_NONE);
  EXPECT_EQ((*head)->Info().optimizer_step(), 0u);
  auto weights_back = (*head)->DownloadWeights(v1::DTYPE_FP32);
  ASSERT_TRUE(weights_back.ok());
  EXPECT_EQ(weights_back->data, weights);
  // And the head can take an optimizer afterwards.
  v1::OptimizerSpec adamw;
  adamw.set_kind(v1::OPTIMIZER_ADAMW);
  EXPECT_TRUE((*head)->SetOptimizer(adamw).ok());
}

}  // namespace
}  // namespace losshead::server
