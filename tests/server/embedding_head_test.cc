// A head tied to its model's input embedding, on every placement the CPU server offers (one
// device, replicated over 2, sharded over 3) with deferred dW off and on: EmbeddingRows answers
// W's rows bit for bit; EMBEDDING_GRAD micro-batches land in the pulled window exactly as a
// float64 scatter-add of the same rows (repeated ids included) on top of the loss micro-batches'
// dW; a repeated key replays without adding, a reused key with other content is ALREADY_EXISTS;
// every bad input is refused with its code and changes nothing.
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"
#include "tests/server/placed_head_util.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::Bytes;
using testing::Decode;
using testing::Encode;
using testing::ExpectClose;
using testing::FromBytes;
using testing::kD;
using testing::MakeSample;
using testing::Pull;
using testing::Pulled;
using testing::RandomFloats;
using testing::Sample;
using testing::Weights;

constexpr int64_t kV = 29;

struct Case {
  v1::PlacementKind placement;
  int devices;
  bool stash;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const char* kind = info.param.placement == v1::PLACEMENT_REPLICATED ? "Replicated"
                     : info.param.placement == v1::PLACEMENT_SHARDED  ? "Sharded"
                                                                      : "Single";
  return absl::StrCat(kind, info.param.devices, info.param.stash ? "_Stash" : "_NoStash");
}

v1::HeadSpec Spec(v1::DType dtype, const Case& c) {
  v1::HeadSpec spec;
  spec.set_name("h");
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(dtype);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  spec.mutable_init()->mutable_normal()->set_seed(11);
  if (c.devices > 1) {
    spec.mutable_placement()->set_kind(c.placement);
    spec.mutable_placement()->set_devices(c.devices);
  }
  return spec;
}

// An EMBEDDING_GRAD micro-batch: dE (ids.size() x kD, fp32) for `ids`.
MicroBatch EmbeddingGrad(const std::vector<int64_t>& ids, const std::vector<float>& grad,
                         const std::string& client, uint64_t sequence) {
  MicroBatch mb;
  mb.header.set_head("h");
  mb.header.set_kind(v1::STEP_KIND_EMBEDDING_GRAD);
  mb.header.set_client_id(client);
  mb.header.set_sequence(sequence);
  mb.header.set_num_tokens(static_cast<int64_t>(ids.size()));
  mb.header.set_hidden_dtype(v1::DTYPE_FP32);
  mb.header.set_target_dtype(v1::DTYPE_INT64);
  mb.hidden = Bytes(grad);
  mb.targets = Bytes(ids);
  return mb;
}

// Unsorted ids over the vocabulary, each of the first three repeated.
std::vector<int64_t> IdsWithRepeats(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> ids(n);
  for (int64_t& id : ids) id = static_cast<int64_t>(rng() % kV);
  for (int i = 0; i < 3 && 2 * i + 5 < n; ++i) ids[2 * i + 5] = ids[i];
  ids.back() = kV - 1;  // the last row: a sharded head's last shard
  return ids;
}

class EmbeddingHeadTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    for (int r = 0; r < GetParam().devices; ++r) {
      auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
      ASSERT_TRUE(backend.ok()) << backend.status();
      owned_.push_back(std::move(*backend));
      devices_.push_back(owned_.back().get());
    }
    auto single = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(single.ok());
    reference_backend_ = std::move(*single);
  }

  std::shared_ptr<Head> MakeHead(v1::DType dtype) {
    HeadOptions options;
    if (GetParam().stash) options.grad_stash_bytes = size_t{1} << 20;
    auto head = Head::Create(devices_, Spec(dtype, GetParam()), options);
    EXPECT_TRUE(head.ok()) << head.status();
    return head.ok() ? *head : nullptr;
  }
  std::shared_ptr<Head> MakeReference(v1::DType dtype) {
    auto head = Head::Create(*reference_backend_, Spec(dtype, Case{}), HeadOptions{});
    EXPECT_TRUE(head.ok()) << head.status();
    return head.ok() ? *head : nullptr;
  }

  std::vector<std::unique_ptr<kernels::Backend>> owned_;
  std::vector<kernels::Backend*> devices_;
  std::unique_ptr<kernels::Backend> reference_backend_;
};

TEST_P(EmbeddingHeadTest, RowsEqualDownloadedWeightsBitForBit) {
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16}) {
    std::shared_ptr<Head> head = MakeHead(dtype);
    ASSERT_NE(head, nullptr);
    const std::string w = Weights(*head);
    const size_t row = kD * kernels::DTypeSize(testing::KernelDType(dtype));
    const std::vector<int64_t> ids = IdsWithRepeats(40, 3);
    auto rows =
        head->EmbeddingRows(v1::DTYPE_INT64, Bytes(ids), v1::DTYPE_UNSPECIFIED, std::nullopt);
    ASSERT_TRUE(rows.ok()) << rows.status();
    EXPECT_EQ(rows->version, 1u);
    EXPECT_EQ(rows->dtype, dtype);
    ASSERT_EQ(rows->data.size(), ids.size() * row);
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_EQ(rows->data.substr(i * row, row), w.substr(ids[i] * row, row)) << "row " << i;
    }
    // int32 ids and another dtype: W's rows converted.
    std::vector<int32_t> ids32(ids.begin(), ids.end());
    auto fp32 = head->EmbeddingRows(v1::DTYPE_INT32, Bytes(ids32), v1::DTYPE_FP32, 1);
    ASSERT_TRUE(fp32.ok()) << fp32.status();
    const std::vector<float> all = Decode(w, dtype);
    const std::vector<float> got = FromBytes<float>(fp32->data);
    for (size_t i = 0; i < ids.size(); ++i) {
      for (int64_t j = 0; j < kD; ++j) ASSERT_EQ(got[i * kD + j], all[ids[i] * kD + j]);
    }
  }
}

TEST_P(EmbeddingHeadTest, GradientRowsLandAsFloat64ScatterAddBesideLossMicroBatches) {
  std::shared_ptr<Head> head = MakeHead(v1::DTYPE_FP32);
  std::shared_ptr<Head> reference = MakeReference(v1::DTYPE_FP32);
  ASSERT_NE(head, nullptr);
  ASSERT_NE(reference, nullptr);
  Sample first = MakeSample(13, kV, v1::DTYPE_FP32, 21, "c", 1);
  Sample second = MakeSample(9, kV, v1::DTYPE_FP32, 22, "c", 3);
  const std::vector<int64_t> ids = IdsWithRepeats(17, 8);
  const std::vector<float> de = RandomFloats(ids.size() * kD, 9);
  const std::vector<int64_t> ids2 = IdsWithRepeats(6, 10);
  const std::vector<float> de2 = RandomFloats(ids2.size() * kD, 11);
  StepStats stats;
  ASSERT_TRUE(head->Step(first.mb, &stats).ok());
  auto added = head->Step(EmbeddingGrad(ids, de, "c", 2), &stats);
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_EQ((*added)->token_count, 0);
  EXPECT_EQ((*added)->weights_version, 1u);
  EXPECT_TRUE((*added)->grad_hidden.empty());
  ASSERT_TRUE(head->Step(second.mb, &stats).ok());
  // Without a key too.
  ASSERT_TRUE(head->Step(EmbeddingGrad(ids2, de2, "", 0), &stats).ok());
  ASSERT_TRUE(reference->Step(first.mb, &stats).ok());
  ASSERT_TRUE(reference->Step(second.mb, &stats).ok());

  const Pulled loss_only = Pull(*reference, false);
  std::vector<double> want(loss_only.values.begin(), loss_only.values.end());
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int64_t j = 0; j < kD; ++j) want[ids[i] * kD + j] += de[i * kD + j];
  }
  for (size_t i = 0; i < ids2.size(); ++i) {
    for (int64_t j = 0; j < kD; ++j) want[ids2[i] * kD + j] += de2[i * kD + j];
  }
  const Pulled got = Pull(*head, true);
  ExpectClose(got.values, want, 2e-6, "dW");
  // Counted as micro-batches of the window, adding no tokens.
  EXPECT_EQ(got.summary.microbatch_count(), 4u);
  EXPECT_EQ(got.summary.token_count(), static_cast<uint64_t>(first.tokens + second.tokens));
  EXPECT_EQ(head->Info().microbatches_total(), 4u);
  EXPECT_EQ(head->Info().tokens_total(), static_cast<uint64_t>(first.tokens + second.tokens));
}

TEST_P(EmbeddingHeadTest, RepeatReplaysAndReusedKeyIsAlreadyExists) {
  std::shared_ptr<Head> head = MakeHead(v1::DTYPE_FP32);
  ASSERT_NE(head, nullptr);
  const std::vector<int64_t> ids = IdsWithRepeats(11, 4);
  const std::vector<float> de = RandomFloats(ids.size() * kD, 5);
  StepStats stats;
  ASSERT_TRUE(head->Step(EmbeddingGrad(ids, de, "c", 7), &stats).ok());
  const Pulled once = Pull(*head, false);
  StepStats again;
  auto replayed = head->Step(EmbeddingGrad(ids, de, "c", 7), &again);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_TRUE(again.replayed);
  std::vector<float> other = de;
  other[3] += 1.0f;
  EXPECT_EQ(head->Step(EmbeddingGrad(ids, other, "c", 7), &stats).status().code(),
            absl::StatusCode::kAlreadyExists);
  // A loss micro-batch under the key is other content too.
  Sample loss = MakeSample(ids.size(), kV, v1::DTYPE_FP32, 6, "c", 7);
  EXPECT_EQ(head->Step(loss.mb, &stats).status().code(), absl::StatusCode::kAlreadyExists);
  const Pulled after = Pull(*head, false);
  EXPECT_EQ(after.values, once.values);
  EXPECT_EQ(after.summary.microbatch_count(), 1u);
}

TEST_P(EmbeddingHeadTest, BadInputIsRefusedWithItsCodeAndChangesNothing) {
  std::shared_ptr<Head> head = MakeHead(v1::DTYPE_FP32);
  ASSERT_NE(head, nullptr);
  StepStats stats;
  const std::vector<int64_t> ids = IdsWithRepeats(5, 12);
  const std::vector<float> de = RandomFloats(ids.size() * kD, 13);
  ASSERT_TRUE(head->Step(EmbeddingGrad(ids, de, "c", 1), &stats).ok());
  const Pulled before = Pull(*head, false);

  struct Bad {
    const char* what;
    MicroBatch mb;
    absl::StatusCode code;
  };
  std::vector<Bad> bad;
  auto base = [&] { return EmbeddingGrad(ids, de, "c", 2); };
  {
    std::vector<int64_t> outside = ids;
    outside[2] = kV;
    bad.push_back({"id V", EmbeddingGrad(outside, de, "c", 2), absl::StatusCode::kInvalidArgument});
    outside[2] = -1;
    bad.push_back(
        {"id -1", EmbeddingGrad(outside, de, "c", 2), absl::StatusCode::kInvalidArgument});
  }
  {
    MicroBatch mb = base();
    mb.hidden.resize(mb.hidden.size() - 4);
    bad.push_back({"short dE", std::move(mb), absl::StatusCode::kInvalidArgument});
  }
  {
    MicroBatch mb = base();
    mb.targets.resize(mb.targets.size() - 8);
    bad.push_back({"short ids", std::move(mb), absl::StatusCode::kInvalidArgument});
  }
  {
    std::vector<float> nan = de;
    nan[7] = std::numeric_limits<float>::quiet_NaN();
    bad.push_back({"NaN", EmbeddingGrad(ids, nan, "c", 2), absl::StatusCode::kInvalidArgument});
    std::vector<float> inf = de;
    inf[9] = -std::numeric_limits<float>::infinity();
    bad.push_back({"Inf", EmbeddingGrad(ids, inf, "c", 2), absl::StatusCode::kInvalidArgument});
  }
  {
    MicroBatch mb = base();
    mb.header.set_hidden_dtype(v1::DTYPE_INT32);
    bad.push_back({"int dE", std::move(mb), absl::StatusCode::kInvalidArgument});
  }
  {
    MicroBatch mb = base();
    mb.header.set_target_dtype(v1::DTYPE_FP32);
    bad.push_back({"float ids", std::move(mb), absl::StatusCode::kInvalidArgument});
  }
  {
    MicroBatch mb = base();
    mb.header.set_hidden_dtype(v1::DTYPE_BF16);  // the bytes are fp32's: a size mismatch
    bad.push_back({"dtype mismatch", std::move(mb), absl::StatusCode::kInvalidArgument});
  }
  {
    MicroBatch mb = base();
    mb.header.mutable_options()->set_grad_scale(2.0f);
    bad.push_back({"grad_scale", std::move(mb), absl::StatusCode::kInvalidArgument});
  }
  {
    MicroBatch mb = base();
    mb.header.mutable_loss_options()->set_z_loss(1e-4f);
    bad.push_back({"loss option", std::move(mb), absl::StatusCode::kInvalidArgument});
  }
  {
    MicroBatch mb = base();
    mb.header.set_kind(static_cast<v1::StepKind>(9));
    bad.push_back({"unknown kind", std::move(mb), absl::StatusCode::kInvalidArgument});
  }
  {
    MicroBatch mb = base();
    mb.header.mutable_options()->set_expected_weights_version(2);
    bad.push_back({"version", std::move(mb), absl::StatusCode::kFailedPrecondition});
  }
  {
    // Two rows of one id that could sum past fp32's range: the window's guard.
    const std::vector<int64_t> twice = {3, 3};
    std::vector<float> huge(2 * kD, 3e38f);
    bad.push_back({"overflow", EmbeddingGrad(twice, huge, "c", 2), absl::StatusCode::kOutOfRange});
  }
  for (Bad& b : bad) {
    EXPECT_EQ(head->Step(b.mb, &stats).status().code(), b.code) << b.what;
  }
  const Pulled after = Pull(*head, false);
  EXPECT_EQ(after.values, before.values);
  EXPECT_EQ(after.summary.microbatch_count(), 1u);
  // Refusals did not use the key up.
  ASSERT_TRUE(head->Step(EmbeddingGrad(ids, de, "c", 2), &stats).ok());
  EXPECT_EQ(Pull(*head, false).summary.microbatch_count(), 2u);
  // And the lookup's own refusals.
  EXPECT_EQ(head->EmbeddingRows(v1::DTYPE_INT64, Bytes(std::vector<int64_t>{kV}),
                                v1::DTYPE_UNSPECIFIED, std::nullopt)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      head->EmbeddingRows(v1::DTYPE_INT64, "", v1::DTYPE_UNSPECIFIED, std::nullopt).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(head->EmbeddingRows(v1::DTYPE_INT64, "abc", v1::DTYPE_UNSPECIFIED, std::nullopt)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(head->EmbeddingRows(v1::DTYPE_FP32, Bytes(std::vector<int64_t>{1}),
                                v1::DTYPE_UNSPECIFIED, std::nullopt)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(head->EmbeddingRows(v1::DTYPE_INT64, Bytes(std::vector<int64_t>{1}), v1::DTYPE_INT32,
                                std::nullopt)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      head->EmbeddingRows(v1::DTYPE_INT64, Bytes(std::vector<int64_t>{1}), v1::DTYPE_UNSPECIFIED, 5)
          .status()
          .code(),
      absl::StatusCode::kFailedPrecondition);
}

TEST_P(EmbeddingHeadTest, OptimizerApplyStepsWithBothContributions) {
  // SGD with lr 1 and no momentum: W' = W - dW / divisor, so W' tells the window exactly.
  HeadOptions options;
  if (GetParam().stash) options.grad_stash_bytes = size_t{1} << 20;
  v1::HeadSpec spec = Spec(v1::DTYPE_FP32, GetParam());
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
  auto made = Head::Create(devices_, spec, options);
  ASSERT_TRUE(made.ok()) << made.status();
  Head& head = **made;
  const std::vector<float> w = Decode(Weights(head), v1::DTYPE_FP32);
  const std::vector<int64_t> ids = IdsWithRepeats(9, 14);
  const std::vector<float> de = RandomFloats(ids.size() * kD, 15);
  StepStats stats;
  ASSERT_TRUE(head.Step(EmbeddingGrad(ids, de, "c", 1), &stats).ok());
  v1::ApplyOptimizerRequest apply;
  apply.set_head("h");
  apply.set_client_id("opt");
  apply.set_step_key(1);
  apply.mutable_params()->set_lr(1.0);
  apply.set_grad_divisor(2.0);
  auto applied = head.ApplyOptimizer(apply);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(applied->window().microbatch_count(), 1u);
  std::vector<double> want(w.begin(), w.end());
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int64_t j = 0; j < kD; ++j) want[ids[i] * kD + j] -= de[i * kD + j] / 2.0;
  }
  ExpectClose(Decode(Weights(head), v1::DTYPE_FP32), want, 2e-6, "W after the apply");
}

INSTANTIATE_TEST_SUITE_P(Placements, EmbeddingHeadTest,
                         ::testing::Values(Case{v1::PLACEMENT_SINGLE, 1, false},
                                           Case{v1::PLACEMENT_SINGLE, 1, true},
                                           Case{v1::PLACEMENT_REPLICATED, 2, false},
                                           Case{v1::PLACEMENT_REPLICATED, 2, true},
                                           Case{v1::PLACEMENT_SHARDED, 3, false},
                                           Case{v1::PLACEMENT_SHARDED, 3, true}),
                         Name);

}  // namespace
}  // namespace losshead::server
