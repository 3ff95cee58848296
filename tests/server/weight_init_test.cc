// The normal init of W (server/engine/weight_init.h): the same values whatever the threads, the
// pieces it is drawn in, or the head's placement; the generator the header documents; and values
// that are normal(0, std), independent across blocks and seeds.
#include "server/engine/weight_init.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"
#include "tests/server/placed_head_util.h"

namespace losshead::server {
namespace {

constexpr int64_t kBlock = kNormalInitBlock;

v1::NormalInit Init(uint64_t seed, float std) {
  v1::NormalInit init;
  init.set_seed(seed);
  init.set_std(std);
  return init;
}

std::vector<float> Draw(const v1::NormalInit& init, int64_t first, int64_t count, int threads) {
  std::vector<float> out(static_cast<size_t>(count));
  EXPECT_TRUE(DrawNormalInit(init, kernels::DType::kFP32, first, count, threads,
                             reinterpret_cast<char*>(out.data())));
  return out;
}

double Correlation(const float* a, const float* b, int64_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (int64_t i = 0; i < n; ++i) {
    ab += double{a[i]} * b[i];
    aa += double{a[i]} * a[i];
    bb += double{b[i]} * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

TEST(WeightInitTest, ThreadsAndPiecesDoNotChangeW) {
  const v1::NormalInit init = Init(0x9e3779b97f4a7c15u, 0.02f);
  const int64_t count = 3 * kBlock + kBlock / 2 + 17;  // a short last block
  const std::vector<float> whole = Draw(init, 0, count, 1);
  for (int threads : {2, 3, 8}) {
    EXPECT_EQ(Draw(init, 0, count, threads), whole) << threads << " threads";
  }
  // In pieces of whole blocks, each drawn alone.
  std::vector<float> pieced = Draw(init, 0, kBlock, 1);
  const std::vector<float> middle = Draw(init, kBlock, 2 * kBlock, 4);
  const std::vector<float> tail = Draw(init, 3 * kBlock, count - 3 * kBlock, 2);
  pieced.insert(pieced.end(), middle.begin(), middle.end());
  pieced.insert(pieced.end(), tail.begin(), tail.end());
  EXPECT_EQ(pieced, whole);
}

TEST(WeightInitTest, EachBlockIsTheDocumentedGenerator) {
  const uint64_t seed = (uint64_t{7} << 32) | 5;
  const v1::NormalInit init = Init(seed, 0.5f);
  const int64_t count = 2 * kBlock + 1000;
  const std::vector<float> got = Draw(init, 0, count, 3);
  for (uint64_t block : {0u, 2u}) {
    std::seed_seq seeds{5u, 7u, static_cast<uint32_t>(block), 0u};
    std::mt19937_64 rng(seeds);
    std::normal_distribution<float> normal(0.0f, 0.5f);
    const int64_t n = std::min(kBlock, count - static_cast<int64_t>(block) * kBlock);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(got[block * kBlock + i], normal(rng)) << "block " << block << " element " << i;
    }
  }
}

TEST(WeightInitTest, ValuesAreNormalAndIndependentAcrossBlocksAndSeeds) {
  const float std = 0.02f;
  const int64_t count = 4 * kBlock;
  const std::vector<float> w = Draw(Init(3, std), 0, count, 4);
  double sum = 0, squares = 0;
  for (float x : w) {
    ASSERT_TRUE(std::isfinite(x));
    sum += x;
    squares += double{x} * x;
  }
  const double mean = sum / count;
  const double sample_std = std::sqrt(squares / count - mean * mean);
  EXPECT_LT(std::abs(mean), 5 * std / std::sqrt(double(count)));
  EXPECT_NEAR(sample_std / std, 1.0, 5e-3);
  // Neighbouring blocks, and the same block under another seed, share no sequence.
  const double bound = 5 / std::sqrt(double(kBlock));
  for (int64_t b = 1; b < 4; ++b) {
    EXPECT_LT(std::abs(Correlation(&w[(b - 1) * kBlock], &w[b * kBlock], kBlock)), bound) << b;
  }
  const std::vector<float> other = Draw(Init(4, std), 0, kBlock, 1);
  EXPECT_LT(std::abs(Correlation(w.data(), other.data(), kBlock)), bound);
}

TEST(WeightInitTest, HalfPrecisionIsTheRoundedFp32Draw) {
  const v1::NormalInit init = Init(21, 1.0f);
  const int64_t count = kBlock + 333;
  const std::vector<float> fp32 = Draw(init, 0, count, 2);
  for (kernels::DType dtype : {kernels::DType::kBF16, kernels::DType::kFP16}) {
    std::string got(count * 2, '\0'), want(count * 2, '\0');
    EXPECT_TRUE(DrawNormalInit(init, dtype, 0, count, 3, got.data()));
    kernels::FromFloat(dtype, fp32.data(), want.data(), fp32.size());
    EXPECT_TRUE(got == want) << static_cast<int>(dtype);
  }
}

// fp16's largest finite value is 65504: 65 std of N(0, 1000^2), but only 3.3 std of N(0, 20000^2),
// which a few thousand of 3 * 2^20 values exceed. The draw reports them, whichever thread drew
// the block; bf16 and fp32 hold such values.
TEST(WeightInitTest, ADrawBeyondTheDtypeIsReported) {
  const int64_t count = 3 * kBlock;
  std::string out(count * 4, '\0');
  EXPECT_TRUE(DrawNormalInit(Init(5, 1e3f), kernels::DType::kFP16, 0, count, 3, out.data()));
  EXPECT_FALSE(DrawNormalInit(Init(5, 2e4f), kernels::DType::kFP16, 0, count, 3, out.data()));
  EXPECT_TRUE(DrawNormalInit(Init(5, 2e4f), kernels::DType::kBF16, 0, count, 3, out.data()));
  EXPECT_TRUE(DrawNormalInit(Init(5, 2e4f), kernels::DType::kFP32, 0, count, 3, out.data()));
}

// A head of several blocks whose shard rows do not start on block boundaries: every placement
// holds the one W the spec draws.
TEST(WeightInitTest, EveryPlacementHoldsTheSameW) {
  constexpr int64_t kV = 1031, kHidden = 2048;  // 2.01 blocks
  std::vector<std::unique_ptr<kernels::Backend>> owned;
  std::vector<kernels::Backend*> devices;
  for (int r = 0; r < 3; ++r) {
    auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(backend.ok()) << backend.status();
    devices.push_back(backend->get());
    owned.push_back(std::move(*backend));
  }
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16}) {
    v1::HeadSpec spec;
    spec.set_name("h");
    spec.set_vocab_size(kV);
    spec.set_hidden_size(kHidden);
    spec.set_weight_dtype(dtype);
    *spec.mutable_init()->mutable_normal() = Init(77, 0.1f);
    const kernels::DType kernel_dtype = testing::KernelDType(dtype);
    std::string want(kV * kHidden * kernels::DTypeSize(kernel_dtype), '\0');
    DrawNormalInit(spec.init().normal(), kernel_dtype, 0, kV * kHidden, 1, want.data());

    auto single = Head::Create(*devices[0], spec, HeadOptions{});
    ASSERT_TRUE(single.ok()) << single.status();
    EXPECT_TRUE(testing::Weights(**single) == want) << "one device, dtype " << dtype;
    for (v1::PlacementKind kind : {v1::PLACEMENT_SHARDED, v1::PLACEMENT_REPLICATED}) {
      spec.mutable_placement()->set_kind(kind);
      spec.mutable_placement()->set_devices(3);
      auto placed = Head::Create(devices, spec, HeadOptions{});
      ASSERT_TRUE(placed.ok()) << placed.status();
      EXPECT_TRUE(testing::Weights(**placed) == want)
          << "placement " << kind << ", dtype " << dtype;
    }
  }
}

}  // namespace
}  // namespace losshead::server
