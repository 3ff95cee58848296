// bf16 / fp16 conversions: exhaustive round trips, round-to-nearest-even at every midpoint, and
// non-finite detection.
#include "losshead/kernels/dtype_convert.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace losshead::kernels {
namespace {

using ToHalf = uint16_t (*)(float);
using FromHalf = float (*)(uint16_t);

bool IsNaNBits(uint16_t h, uint16_t exponent_mask) {
  return (h & exponent_mask) == exponent_mask &&
         (h & static_cast<uint16_t>(~exponent_mask & 0x7fff));
}

void ExpectExactRoundTrip(ToHalf to, FromHalf from, uint16_t exponent_mask) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = from(bits);
    if (IsNaNBits(bits, exponent_mask)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      ASSERT_TRUE(std::isnan(from(to(f)))) << h;
    } else {
      ASSERT_EQ(to(f), bits) << "bits " << h;
    }
  }
}

// For every pair of adjacent finite values a < b of one sign, the fp32 midpoint (exact: the
// 16-bit formats have fewer mantissa bits than fp32) must round to the one with an even mantissa,
// and the floats just beside it to the nearer one.
void ExpectNearestEven(ToHalf to, FromHalf from, uint16_t max_finite) {
  for (uint16_t sign : {uint16_t{0}, uint16_t{0x8000}}) {
    for (uint16_t a = 0; a < max_finite; ++a) {
      const uint16_t lo = sign | a, hi = sign | static_cast<uint16_t>(a + 1);
      // In double: the sum of the two largest values would overflow fp32.
      const float mid = static_cast<float>((double{from(lo)} + double{from(hi)}) / 2);
      ASSERT_EQ(to(mid), (lo & 1) == 0 ? lo : hi) << "between " << a << " and " << a + 1;
      const float toward_hi = std::nextafter(mid, from(hi));
      const float toward_lo = std::nextafter(mid, from(lo));
      ASSERT_EQ(to(toward_hi), hi) << a;
      ASSERT_EQ(to(toward_lo), lo) << a;
    }
  }
}

TEST(DTypeConvertTest, BF16_AllBitPatternsRoundTrip) {
  ExpectExactRoundTrip(FloatToBf16, Bf16ToFloat, 0x7f80);
}

TEST(DTypeConvertTest, FP16_AllBitPatternsRoundTrip) {
  ExpectExactRoundTrip(FloatToFp16, Fp16ToFloat, 0x7c00);
}

TEST(DTypeConvertTest, BF16_RoundsToNearestEvenAtEveryMidpoint) {
  ExpectNearestEven(FloatToBf16, Bf16ToFloat, 0x7f7f);
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f), 0x3f80);      // tie, down to even
  EXPECT_EQ(FloatToBf16(1.0f + 3 * 0x1p-8f), 0x3f82);  // tie, up to even
}

TEST(DTypeConvertTest, FP16_RoundsToNearestEvenAtEveryMidpointIncludingSubnormals) {
  ExpectNearestEven(FloatToFp16, Fp16ToFloat, 0x7bff);
  EXPECT_EQ(FloatToFp16(0x1p-25f), 0x0000);      // half the smallest subnormal: tie to zero
  EXPECT_EQ(FloatToFp16(3 * 0x1p-26f), 0x0001);  // 0.75 of it rounds up
  EXPECT_EQ(FloatToFp16(3 * 0x1p-25f), 0x0002);  // 1.5: tie, up to even
}

TEST(DTypeConvertTest, FP16_OverflowsToInfinityPastTheLastMidpoint) {
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToFp16(-1e9f), 0xfc00);
  EXPECT_EQ(FloatToFp16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DTypeConvertTest, BF16_NaNStaysNaNAndLargeValuesOverflowToInfinity) {
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload lives only in the low half must not truncate to infinity.
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::bit_cast<float>(0x7f800001u)))));
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
}

TEST(DTypeConvertTest, AllDTypes_BulkConversionsMatchScalar) {
  std::vector<float> values;
  for (int i = -300; i <= 300; ++i) values.push_back(std::ldexp(1.0f + i / 301.0f, i / 10));
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::vector<uint8_t> packed(values.size() * DTypeSize(dtype));
    FromFloat(dtype, values.data(), packed.data(), values.size());
    std::vector<float> back(values.size());
    ToFloat(dtype, packed.data(), back.data(), values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      float expected = values[i];
      if (dtype == DType::kBF16) expected = Bf16ToFloat(FloatToBf16(values[i]));
      if (dtype == DType::kFP16) expected = Fp16ToFloat(FloatToFp16(values[i]));
      ASSERT_EQ(back[i], expected) << i;
    }
  }
}

TEST(DTypeConvertTest, AllDTypes_HasNonFiniteFindsInfAndNaNOnly) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    SCOPED_TRACE(DTypeName(dtype));
    const float largest = dtype == DType::kFP16 ? 65504.0f : Bf16ToFloat(0x7f7f);
    std::vector<float> values = {0.0f, -0.0f, 1.0f, -largest, largest, 1e-30f, 3.0f};
    std::vector<uint8_t> packed(values.size() * DTypeSize(dtype));
    FromFloat(dtype, values.data(), packed.data(), values.size());
    EXPECT_FALSE(HasNonFinite(dtype, packed.data(), values.size()));
    for (float bad : {inf, -inf, nan}) {
      std::vector<float> with_bad = values;
      with_bad[values.size() - 1] = bad;
      FromFloat(dtype, with_bad.data(), packed.data(), with_bad.size());
      EXPECT_TRUE(HasNonFinite(dtype, packed.data(), with_bad.size())) << bad;
      // Only the counted prefix is inspected.
      EXPECT_FALSE(HasNonFinite(dtype, packed.data(), with_bad.size() - 1)) << bad;
    }
  }
}

// The scan works in blocks: a bad value anywhere, at block edges too, in a tensor of several blocks
// and a ragged tail, is found; the same tensor without it is clean.
TEST(DTypeConvertTest, AllDTypes_HasNonFiniteFindsABadValueAtAnyPosition) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  constexpr size_t kCount = 3 * 4096 + 17;
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::vector<float> values(kCount);
    for (size_t i = 0; i < kCount; ++i) values[i] = static_cast<float>(i % 251) - 125.0f;
    std::vector<uint8_t> packed(kCount * DTypeSize(dtype));
    FromFloat(dtype, values.data(), packed.data(), kCount);
    EXPECT_FALSE(HasNonFinite(dtype, packed.data(), kCount));
    for (size_t at : {size_t{0}, size_t{4095}, size_t{4096}, size_t{2 * 4096 + 5}, size_t{3 * 4096},
                      kCount - 1}) {
      std::vector<float> with_bad = values;
      with_bad[at] = nan;
      FromFloat(dtype, with_bad.data(), packed.data(), kCount);
      EXPECT_TRUE(HasNonFinite(dtype, packed.data(), kCount)) << at;
    }
  }
}

// MaxAbs against the largest |x| taken in fp64 of the decoded values, for random magnitudes over
// each dtype's range, negative maxima and subnormals included; Inf or NaN anywhere reads +Inf.
TEST(DTypeConvertTest, AllDTypes_MaxAbsIsTheLargestMagnitude) {
  std::mt19937_64 rng(17);
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    SCOPED_TRACE(DTypeName(dtype));
    const int max_exp = dtype == DType::kFP16 ? 15 : 127;
    std::uniform_int_distribution<int> exponent(-max_exp - 8, max_exp);
    std::uniform_real_distribution<float> mantissa(-2.0f, 2.0f);
    for (size_t count : {size_t{1}, size_t{7}, size_t{4096}, size_t{3 * 4096 + 17}}) {
      std::vector<float> values(count);
      for (float& x : values) x = std::ldexp(mantissa(rng), exponent(rng)) / 2;
      std::vector<uint8_t> packed(count * DTypeSize(dtype));
      FromFloat(dtype, values.data(), packed.data(), count);
      std::vector<float> decoded(count);
      ToFloat(dtype, packed.data(), decoded.data(), count);
      double want = 0;
      for (float x : decoded) want = std::max(want, std::fabs(static_cast<double>(x)));
      EXPECT_EQ(static_cast<double>(MaxAbs(dtype, packed.data(), count)), want) << count;
      for (float bad : {std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN()}) {
        std::vector<float> with_bad = values;
        with_bad[count / 2] = bad;
        FromFloat(dtype, with_bad.data(), packed.data(), count);
        EXPECT_EQ(MaxAbs(dtype, packed.data(), count), std::numeric_limits<float>::infinity());
      }
    }
    EXPECT_EQ(MaxAbs(dtype, nullptr, 0), 0.0f);
  }
}

}  // namespace
}  // namespace losshead::kernels
